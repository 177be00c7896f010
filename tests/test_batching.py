"""Continuous batching: rounds of different sessions that arrive together share forward
passes, and each session gets exactly what it gets alone."""
from __future__ import annotations

import threading

import pytest
import torch

from drafter_service.drafting import VerifierState
from drafter_service.selection import drafter_for
from specdec.core.batching import Batcher, ComputeThread, Lockstep, run_alone
from specdec.core.feature_head import features_to_state
from specdec.core.models import ModelSpec
from specdec.core.sampling import Sampling
from specdec.core.tree import DraftTree, TreeShape
from tests.test_feature_head import head_dir  # noqa: F401 - the fixture
from verifier_service.verifier import Verifier

PROMPTS = [[1, 5, 7, 3, 9], [2, 2, 8], [6, 1, 4, 4, 9, 12, 3], [11, 3]]
TREE = DraftTree([4, 6, 8, 10], [-1, -1, 0, 2])


def rounds(engine: Verifier, tag: str, sampling: Sampling):
    """Each prompt's session: a fused round (prefill, 3 tokens), then a tree."""
    sessions = [engine.open_session(f"{tag}{i}", prompt, sampling) for i, prompt in enumerate(PROMPTS)]
    return sessions, [
        lambda s: engine.verify_job(s, 1, DraftTree([], []), 3),
        lambda s: engine.verify_job(s, 2, TREE, 0),
    ]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, 0.9, 0, 7)], ids=["greedy", "sampled"])
def test_sessions_batched_together_get_what_each_gets_alone(tiny_dirs, sampling):
    engine = Verifier(ModelSpec(str(tiny_dirs["verifier"]), dtype="int8"))
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
    engine = Verifier(ModelSpec(str(tiny_dirs["verifier"]), dtype="int8"))
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


# The drafter: draft jobs of several sessions share forwards, and each gets its drafts alone.


def lockstep_run(jobs, forward_many) -> tuple[list, int]:
    """The jobs advanced together; their values and the passes they took."""
    passes, values = [0], [None] * len(jobs)

    def counted(calls):
        passes[0] += 1
        return forward_many(calls)

    lockstep = Lockstep(counted)
    with torch.inference_mode():
        for i, job in enumerate(jobs):
            lockstep.add(job, lambda value, error, i=i: values.__setitem__(i, value if error is None else error))
        while lockstep.waiting:
            lockstep.step()
    return values, passes[0]


def assert_drafts_batch_exactly(engine, shape: TreeShape, verifier_state=lambda committed: None) -> None:
    """`verifier_state(committed)`: what a draft after `committed` tokens is sent (a feature head's)."""
    def jobs(tag: str, round_number: int, sessions):
        new = [] if round_number == 1 else [3, 5]  # the second round commits two tokens first
        return [
            engine.draft_job(
                session_id=f"{tag}{i}", session=s, new_tokens=new, committed_length=len(p) + len(new), num_tokens=5, shape=shape,
                verifier_state=verifier_state(len(p) + len(new)), round_number=round_number,
            )
            for i, (s, p) in enumerate(zip(sessions, PROMPTS))
        ]

    open_all = lambda tag: [engine.open_session(f"{tag}{i}", p, Sampling(), "") for i, p in enumerate(PROMPTS)]  # noqa: E731
    alone_sessions, together_sessions = open_all("alone"), open_all("together")
    for round_number in (1, 2):
        alone = [run_alone(job, engine.forward_many) for job in jobs("alone", round_number, alone_sessions)]
        together, passes = lockstep_run(jobs("together", round_number, together_sessions), engine.forward_many)
        assert [(d.tree.token_ids, d.tree.parent) for d in together] == [(d.tree.token_ids, d.tree.parent) for d in alone]
        assert passes < sum(d.forward_passes for d in alone)  # the sessions shared passes


@pytest.mark.parametrize("method", ["chain", "dynamic"])
def test_model_drafts_batched_together_are_the_drafts_each_gets_alone(tiny_dirs, method):
    engine = drafter_for(ModelSpec(str(tiny_dirs["drafter"]), dtype="int8"))
    assert engine.drafter.inner.engine.native_layers is not None
    assert_drafts_batch_exactly(engine, TreeShape(method, width=2))


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_feature_head_drafts_batched_together_are_the_drafts_each_gets_alone(head_dir, dtype):  # noqa: F811
    engine = drafter_for(ModelSpec(str(head_dir), dtype=dtype))
    assert (engine.drafter.inner.native_layer is not None) == (dtype == "int8")
    def features(committed: int) -> VerifierState:
        return VerifierState(**features_to_state(0, torch.randn(committed - 1, 32, generator=torch.Generator().manual_seed(committed))))

    assert_drafts_batch_exactly(engine, TreeShape("dynamic", width=2), features)
