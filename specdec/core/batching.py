"""Continuous batching across sessions. A service's unit of work is a job: a generator that
yields the forward passes it needs (the engine's ForwardCall, or a drafter's own forward type)
and receives each one's result. Jobs advance
in lockstep, one `forward_many` per step over the calls they wait on, and a job that arrives
joins at the next step: one stream alone never waits for a batch to fill, and many streams
share each pass over the weights."""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Generator, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch


class ComputeThread:
    """The one thread that runs all of a service's torch work, model loading included.

    OpenMP lets its workers spin between parallel regions only while a process has no more
    OpenMP threads than cores. Every other thread that runs torch ops brings a worker team of
    its own, and then each of the ~150 parallel regions of a forward waits for sleeping workers
    to wake: on 2 cores a one-token step took 25 ms from gRPC handler threads, 12 ms here."""

    def __init__(self):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    def run(self, fn, *args, **kwargs):
        return self._executor.submit(fn, *args, **kwargs).result()

    def submit(self, fn, *args) -> None:
        """Queues `fn` without waiting for it."""
        self._executor.submit(fn, *args)


Forward = TypeVar("Forward")  # what a job yields: whatever its service's forward_many runs together
Job = Generator[Forward, Any, Any]
ForwardMany = Callable[[list[Forward]], list[Any]]
Done = Callable[[Any, BaseException | None], None]  # (the job's value, None) or (None, its error)


class Lockstep:
    """Jobs advanced together: each `step` runs one pass over the calls they wait on."""

    def __init__(self, forward_many: ForwardMany):
        self.forward_many = forward_many
        self.waiting: list[tuple[Job, Any, Done]] = []

    def add(self, job: Job, done: Done) -> None:
        self._advance(job, done, None, None)

    def step(self) -> None:
        waiting, self.waiting = self.waiting, []
        try:
            results = self.forward_many([call for _, call, _ in waiting])
        except Exception as err:  # noqa: BLE001 - a failed pass fails the jobs that shared it
            for job, _, done in waiting:
                self._advance(job, done, None, err)
            return
        for (job, _, done), result in zip(waiting, results):
            self._advance(job, done, result, None)

    def _advance(self, job: Job, done: Done, value: Any, error: BaseException | None) -> None:
        try:
            call = job.throw(error) if error is not None else job.send(value)
        except StopIteration as finished:
            done(finished.value, None)
        except Exception as err:  # noqa: BLE001 - the job's own failure goes back to its caller
            done(None, err)
        else:
            self.waiting.append((job, call, done))


def forwardless(fn: Callable[..., Any]) -> Callable[..., Job]:
    """`fn` as a job that needs no forward (a drafter without a model): it ends at its first
    step with fn's value."""

    @functools.wraps(fn)
    def job(*args, **kwargs) -> Job:
        yield from ()
        return fn(*args, **kwargs)

    return job


def run_alone(job: Job, forward_many: ForwardMany) -> Any:
    """Runs one job to its end on this thread and returns its value (or raises its error)."""
    outcome: list = []
    lockstep = Lockstep(forward_many)
    with torch.inference_mode():  # the caches a pass grows are inference tensors the job edits
        lockstep.add(job, lambda value, error: outcome.extend([value, error]))
        while lockstep.waiting:
            lockstep.step()
    value, error = outcome
    if error is not None:
        raise error
    return value


class Batcher:
    """Runs jobs on the compute thread, batched with every other job running or queued. Jobs
    with the same key (a session) never run at once: a session's jobs run in the order they
    came. Counts batches (passes), the calls in them and the time jobs queued, for metrics."""

    def __init__(self, compute: ComputeThread, forward_many: ForwardMany, max_jobs: int = 64):
        self.compute, self.forward_many, self.max_jobs = compute, forward_many, max_jobs
        self._queue: list[tuple[Job, Hashable, Future, float]] = []
        self._lock = threading.Lock()
        self._running = False
        self.passes = self.calls = self.jobs = 0
        self.queue_ms = 0.0

    def run(self, job: Job, key: Hashable) -> Any:
        """Runs `job` with whatever else is running and returns its value (or raises its error)."""
        future: Future = Future()
        with self._lock:
            self._queue.append((job, key, future, time.perf_counter()))
            if not self._running:
                self._running = True
                self.compute.submit(self._loop)
        return future.result()

    def call(self, key: Hashable, fn: Callable[..., Any], *args) -> Any:
        """fn(*args) on the compute thread between two steps (not after the running jobs end),
        in turn with the jobs of `key`; returns its value."""
        return self.run(forwardless(fn)(*args), key)

    def _loop(self) -> None:
        lockstep = Lockstep(self._counted)
        running: set[Hashable] = set()
        with torch.inference_mode():
            while True:
                with self._lock:
                    admitted = self._admit(running)
                    if not admitted and not lockstep.waiting:
                        self._running = False
                        return
                for job, key, future, queued in admitted:
                    self.jobs += 1
                    self.queue_ms += (time.perf_counter() - queued) * 1e3
                    lockstep.add(job, self._finisher(key, future, running))
                if lockstep.waiting:
                    lockstep.step()

    def _admit(self, running: set[Hashable]) -> list[tuple[Job, Hashable, Future, float]]:
        admitted, kept = [], []
        for item in self._queue:
            key = item[1]
            if key in running or len(running) >= self.max_jobs:
                kept.append(item)
            else:
                running.add(key)
                admitted.append(item)
        self._queue = kept
        return admitted

    @staticmethod
    def _finisher(key: Hashable, future: Future, running: set[Hashable]) -> Done:
        def done(value: Any, error: BaseException | None) -> None:
            running.discard(key)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        return done

    def _counted(self, calls: list) -> list[Any]:
        self.passes += 1
        self.calls += len(calls)
        return self.forward_many(calls)
