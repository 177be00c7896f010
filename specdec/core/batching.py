"""Continuous batching across sessions. A service's work item is a job: a generator that
yields the forward passes it needs (ForwardCall) and receives each one's result. The compute
thread runs every job queued when it comes free together, in lockstep: one `forward_many`
per step over the calls the unfinished jobs wait on. Jobs that arrive meanwhile wait for the
next batch, so one stream alone never waits for a batch to fill, and many streams share each
pass over the weights."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core.engine import ComputeThread, ForwardCall

Job = Generator[ForwardCall, Any, Any]
ForwardMany = Callable[[list[ForwardCall]], list[Any]]


def run_together(jobs: list[Job], forward_many: ForwardMany) -> list[tuple[Any, BaseException | None]]:
    """Runs the jobs to their ends; each job's (return value, None) or (None, its exception)."""
    outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(jobs)
    waiting: dict[int, ForwardCall] = {}

    def advance(index: int, value: Any = None, error: BaseException | None = None) -> None:
        try:
            call = jobs[index].throw(error) if error is not None else jobs[index].send(value)
            waiting[index] = call
        except StopIteration as done:
            outcomes[index] = (done.value, None)
        except Exception as err:  # noqa: BLE001 - the job's own failure goes back to its caller
            outcomes[index] = (None, err)

    with torch.inference_mode():  # the caches a pass grows are inference tensors the jobs edit
        for index in range(len(jobs)):
            advance(index)
        while waiting:
            indices, calls = list(waiting), list(waiting.values())
            waiting.clear()
            try:
                results = forward_many(calls)
            except Exception as err:  # noqa: BLE001 - a failed pass fails the jobs that shared it
                for index in indices:
                    advance(index, error=err)
                continue
            for index, result in zip(indices, results):
                advance(index, result)
    return outcomes


def run_alone(job: Job, forward_many: ForwardMany) -> Any:
    value, error = run_together([job], forward_many)[0]
    if error is not None:
        raise error
    return value


@dataclass
class BatchStats:
    """What the batcher has done, for metrics: batches run, jobs in them, their queue time."""

    batches: int = 0
    jobs: int = 0
    forward_passes: int = 0
    queue_ms: float = 0.0
    last_batch_jobs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Batcher:
    """Runs jobs on the compute thread, batching those queued together. Jobs with the same key
    (a session) never share a batch: a session's jobs run in the order they came."""

    def __init__(self, compute: ComputeThread, forward_many: ForwardMany, max_jobs: int = 64):
        self.compute, self.forward_many, self.max_jobs = compute, forward_many, max_jobs
        self._queue: list[tuple[Job, Hashable, Future, float]] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self.stats = BatchStats()

    def run(self, job: Job, key: Hashable) -> Any:
        """Runs `job` with whatever else is queued and returns its value (or raises its error)."""
        future: Future = Future()
        with self._lock:
            self._queue.append((job, key, future, time.perf_counter()))
            if not self._scheduled:
                self._scheduled = True
                self.compute.submit(self._drain)
        return future.result()

    def _drain(self) -> None:
        with self._lock:
            batch, rest, keys = [], [], set()
            for item in self._queue:
                if item[1] in keys or len(batch) >= self.max_jobs:
                    rest.append(item)
                else:
                    keys.add(item[1])
                    batch.append(item)
            self._queue = rest
            self._scheduled = bool(rest)
            if rest:
                self.compute.submit(self._drain)
        started = time.perf_counter()
        passes = 0

        def counted(calls: list[ForwardCall]) -> list[Any]:
            nonlocal passes
            passes += 1
            return self.forward_many(calls)

        outcomes = run_together([job for job, *_ in batch], counted)
        with self.stats.lock:
            self.stats.batches += 1
            self.stats.jobs += len(batch)
            self.stats.forward_passes += passes
            self.stats.queue_ms += sum((started - queued) * 1e3 for *_, queued in batch)
            self.stats.last_batch_jobs = len(batch)
        for (_, _, future, _), (value, error) in zip(batch, outcomes):
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
