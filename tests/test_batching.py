"""Continuous batching: rounds of different sessions that arrive together share forward
passes, and each session gets exactly what it gets alone."""
from __future__ import annotations

import threading

import pytest

from specdec.core.batching import Batcher
from specdec.core.engine import ComputeThread
from specdec.core.models import ModelSpec
from specdec.core.sampling import Sampling
from specdec.core.tree import DraftTree
from verifier_service.verifier import VerifierEngine

PROMPTS = [[1, 5, 7, 3, 9], [2, 2, 8], [6, 1, 4, 4, 9, 12, 3], [11, 3]]
TREE = DraftTree([4, 6, 8, 10], [-1, -1, 0, 2])


def rounds(engine: VerifierEngine, tag: str, sampling: Sampling):
    """Each prompt's session: a fused round (prefill, 3 tokens with features), then a tree."""
    sessions = [engine.open_session(f"{tag}{i}", prompt, sampling) for i, prompt in enumerate(PROMPTS)]
    return sessions, [
        lambda s: engine.verify_job(s, 1, DraftTree([], []), 3),
        lambda s: engine.verify_job(s, 2, TREE, 0),
    ]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, 0.9, 0, 7)], ids=["greedy", "sampled"])
def test_sessions_batched_together_get_what_each_gets_alone(tiny_dirs, sampling):
    engine = VerifierEngine(ModelSpec(str(tiny_dirs["verifier"]), dtype="int8"))
    assert engine.engine.native_layers is not None
    alone_sessions, steps = rounds(engine, "alone", sampling)
    alone = [[engine.verify(s, 1, DraftTree([], []), 3), engine.verify(s, 2, TREE, 0)] for s in alone_sessions]

    compute = ComputeThread()
    batcher = Batcher(compute, engine.forward_many)
    sessions, _ = rounds(engine, "together", sampling)
    release = threading.Event()
    compute.submit(release.wait)  # holds the compute thread until every session has queued
    results = [[None, None] for _ in sessions]

    def stream(i: int) -> None:
        for r, step in enumerate(steps):
            results[i][r] = batcher.run(step(sessions[i]), key=f"together{i}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    while len(batcher._queue) < len(sessions):
        threading.Event().wait(0.01)
    release.set()
    for thread in threads:
        thread.join()
    for together, expected in zip(results, alone):
        assert [r.token_ids for r in together] == [r.token_ids for r in expected]
        assert [r.committed_length for r in together] == [r.committed_length for r in expected]
    assert batcher.jobs == 2 * len(sessions)
    # The fused rounds ran side by side: far fewer passes than calls.
    assert batcher.calls > batcher.passes


def test_a_failing_job_fails_alone(tiny_dirs):
    """A bad round answers its own caller with its error; the sessions batched with it go on."""
    engine = VerifierEngine(ModelSpec(str(tiny_dirs["verifier"]), dtype="int8"))
    compute = ComputeThread()
    batcher = Batcher(compute, engine.forward_many)
    good = engine.open_session("good", PROMPTS[0], Sampling())
    bad = engine.open_session("bad", PROMPTS[1], Sampling())
    errors = []

    def out_of_order() -> None:
        try:
            batcher.run(engine.verify_job(bad, 5, TREE, 0), key="bad")
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=out_of_order)
    thread.start()
    result = batcher.run(engine.verify_job(good, 1, TREE, 0), key="good")
    thread.join()
    assert result.committed_length > len(PROMPTS[0]) and len(errors) == 1 and "out of order" in str(errors[0])
