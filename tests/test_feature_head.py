"""The verifier-feature drafter (EAGLE-3 style): the training-time test computes exactly what
a live draft computes, the verifier sends the features of exactly the positions it commits,
the services stay exact with it for every tree method and for sampling, bad features are
refused, and a short training run on tiny models aligns the head and resumes after a kill."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.clients import PairMismatch, VerifierStateLog
from drafter_service.drafting import VerifierState
from drafter_service.selection import drafter_for
from specdec.core.feature_head import FeatureHead, features_from_state, features_to_state, load_feature_fuse, save_feature_head
from specdec.core.models import ModelSpec, hf_greedy, load_model
from specdec.core.sampling import Sampling
from specdec.core.tree import DraftTree, TreeShape
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import parse
from specdec.serving.rpc import MeasuredClient
from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE
from specdec.train.distill_head import FeatureHeadConfig, run_feature_head
from specdec.train.unroll import unrolled, unrolled_loss
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from tests.conftest import local_stack, service_pair, tiny_config
from tests.test_distill import assert_resumes_after_kill, tiny_prompts  # noqa: F401 (a fixture)
from tests.test_services import sampled_first_two_tokens
from verifier_service.verifier import Verifier

LAYERS = [0, 1, 2]  # embeddings and both layers of the tiny verifier
VOCAB = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # a reduced draft vocabulary (EOS included)


@pytest.fixture(scope="module")
def head_dir(tiny_dirs, tmp_path_factory) -> Path:
    """An untrained head with random fc and fuse, so every part of the math shows."""
    verifier = load_model(ModelSpec(str(tiny_dirs["verifier"])))
    head = FeatureHead.from_verifier(verifier, LAYERS, VOCAB)
    torch.manual_seed(5)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.3)
        head.fuse.proj.weight.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("feature_head") / "head"
    save_feature_head(out, head, str(tiny_dirs["verifier"]), {"test": True}, dtype="float32")
    return out


def test_checkpoint_stores_neither_embeddings_nor_head_rows(head_dir):
    from safetensors.torch import load_file

    stored = load_file(head_dir / "feature_head.safetensors")
    assert not any(k.startswith(("embed.", "lm_head.")) for k in stored)
    assert {"fuse.proj.weight", "fc.weight", "layer.q.weight", "norm.weight"} <= set(stored)
    assert json.loads((head_dir / "draft_vocab.json").read_text()) == VOCAB


def test_training_time_test_computes_what_a_live_draft_computes(head_dir):
    """Step k of the unrolled head at position i equals the k-th token of a live chain drafted
    after position i-k+1 by the drafter service's own code."""
    drafter = drafter_for(ModelSpec(str(head_dir)))
    head = drafter.drafter.inner.head
    context = [1, 4, 7, 3, 9, 5]
    features = torch.randn(len(context) + 3, head.hidden_size).half().float()  # as they travel
    session = drafter.open_session("s", context, Sampling(0.0, 1.0, 0, 0), "")
    tree = drafter.draft(session_id="s", session=session, new_tokens=[], committed_length=len(context), num_tokens=3,
                         shape=TreeShape("chain"), verifier_state=VerifierState(**features_to_state(0, features[: len(context) - 1]))).tree
    chain = tree.token_ids
    assert tree.parent == [-1, 0, 1]
    sequence = torch.tensor([context + chain])
    previous = torch.zeros(1, sequence.shape[1], head.hidden_size)
    previous[0, 1:] = features[: sequence.shape[1] - 1]
    valid = torch.ones_like(sequence, dtype=torch.bool)
    with torch.no_grad():
        steps = unrolled(head, sequence, previous, valid, 3, window=2)
        n = len(context) - 1  # the last committed position: the root of the draft
        for k, token in enumerate(chain, start=1):
            out = steps[0][0, n] if k == 1 else steps[k - 1][0, n + k - 1 - 2]
            assert int(head.vocab_ids[head.logits(out).argmax()]) == token
        # And the outputs themselves, against the head run by hand over a cache.
        causal = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()[None, None]
        first, keys, values = head(sequence[:, : n + 1], previous[:, : n + 1], torch.arange(n + 1)[None], mask=causal)
        second, k2, v2 = head(sequence[:, n + 1 : n + 2], first[:, -1:], torch.tensor([[n + 1]]), keys, values)
        torch.testing.assert_close(second[0, 0], steps[1][0, n + 1 - 2], atol=1e-4, rtol=1e-3)
        third, _, _ = head(
            sequence[:, n + 2 : n + 3], second, torch.tensor([[n + 2]]), torch.cat([keys, k2], 2), torch.cat([values, v2], 2)
        )
        torch.testing.assert_close(third[0, 0], steps[2][0, n + 2 - 2], atol=1e-4, rtol=1e-3)


def test_verifier_sends_the_features_of_exactly_the_committed_positions(tiny_dirs, head_dir):
    verifier = Verifier(ModelSpec(str(tiny_dirs["verifier"])), feature_checkpoint=str(head_dir))
    plain = load_model(ModelSpec(str(tiny_dirs["verifier"])))
    fuse = load_feature_fuse(str(head_dir), plain)
    prompt = [1, 4, 7, 3]
    session = verifier.open_session("s", prompt, Sampling(0.0, 1.0, 0, 0))
    first = verifier.verify(session, 1, DraftTree([], []), 3, verifier_state=True)
    assert first.verifier_state["start"] == 0 and first.verifier_state["positions"] == len(prompt) + 2
    guess = hf_greedy(plain, session.tokens, 2)
    tree = DraftTree([guess[0], (guess[0] + 1) % 16, guess[1]], [-1, -1, 0])
    second = verifier.verify(session, 2, tree, 0, verifier_state=True)
    # Pending (the last token of round 1) plus the accepted path (both greedy guesses).
    assert second.num_accepted == 2 and second.verifier_state["start"] == len(prompt) + 2
    assert second.verifier_state["positions"] == 1 + second.num_accepted
    with torch.no_grad():
        hidden = plain(torch.tensor([session.tokens]), output_hidden_states=True).hidden_states
        expected = fuse(tuple(h[0] for h in hidden)).half().float()
    rows = torch.cat([_rows(first), _rows(second)])
    torch.testing.assert_close(rows, expected[: len(rows)], atol=2e-3, rtol=2e-3)
    assert len(rows) == len(session.tokens) - 1

    # A session that keeps its features sends them only when a round asks, all not sent before.
    kept = verifier.open_session("k", prompt, Sampling(0.0, 1.0, 0, 0), keep_verifier_state=True)
    assert verifier.verify(kept, 1, DraftTree([], []), 3).verifier_state is None
    assert verifier.verify(kept, 2, tree, 0).verifier_state is None  # the same tokens as `session` so far
    caught_up = verifier.verify(kept, 3, DraftTree([], []), 1, verifier_state=True)
    assert caught_up.verifier_state["start"] == 0 and caught_up.verifier_state["positions"] == len(kept.tokens) - 1
    # Fused in one batch here and in two above: a float32 product's last bit may differ with
    # the rows fused together, and then its float16 rounding by one step (seen once in a suite run).
    torch.testing.assert_close(_rows(caught_up)[: len(rows)], rows, atol=2e-3, rtol=2e-3)
    assert verifier.verify(kept, 4, DraftTree([], []), 2, verifier_state=True).verifier_state["start"] == len(kept.tokens) - 3


def _rows(result) -> torch.Tensor:
    return features_from_state(result.verifier_state["positions"], result.verifier_state["records"], 32)


def _config(tiny_dirs, head_dir, **coordinator) -> dict:
    return {
        "verifier": {"model": str(tiny_dirs["verifier"]), "torch_threads": 1},
        "drafter": {"model": str(head_dir), "torch_threads": 1},
        "coordinator": {"num_draft_tokens": 3, "adaptive": {"enabled": False}, **coordinator},
    }


@pytest.fixture(scope="module")
def feature_stack(tiny_dirs, head_dir):
    with local_stack(_config(tiny_dirs, head_dir)) as stack:
        yield stack


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"num_draft_tokens": 6, "tree": {"method": "dynamic", "width": 2}},
        {"num_draft_tokens": 6, "tree": {"method": "static", "branching": [2, 2]}},
        {"overlap": True},
        {"adaptive": True},
    ],
    ids=["chain", "dynamic", "static", "overlap", "adaptive"],
)
def test_greedy_output_equals_the_verifier_alone(feature_stack, tiny_verifier, fields):
    client = CoordinatorClient(feature_stack["coordinator"])
    for prompt in ([1, 4, 5], [1, 9, 3, 3, 8]):
        request = generate_request(prompt_token_ids=prompt, max_new_tokens=24)
        for key, value in fields.items():
            if key == "tree":
                request.tree.CopyFrom(common_pb2.TreeShape(**value))
            else:
                setattr(request, key, value)
        reply = client.generate(request)
        assert list(reply.token_ids) == hf_greedy(tiny_verifier, prompt, 24)
        # Features travel before drafting rounds only: adaptive rounds that all chose the
        # verifier alone send none.
        stats = reply.stats
        assert stats.verifier_state and (stats.verifier_state_bytes > 0 or ("adaptive" in fields and not stats.speculative_rounds))
    client.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_coordinator_running_the_verifier_decodes_exactly(tiny_dirs, head_dir, tiny_verifier, overlap):
    """coordinator.verifier_in_process: the verifier (features included) is called in the
    coordinator's process and the drafter over gRPC; rounds cross one link."""
    config = _config(
        tiny_dirs, head_dir, verifier_in_process=True, overlap=overlap, num_draft_tokens=6, tree={"method": "dynamic", "width": 2}
    )
    with local_stack(config) as stack:
        assert "verifier" not in stack and "drafter" in stack  # no verifier server
        client = CoordinatorClient(stack["coordinator"])
        for prompt in ([1, 4, 5], [1, 9, 3, 3, 8]):
            reply = client.generate(generate_request(prompt_token_ids=prompt, max_new_tokens=24))
            assert list(reply.token_ids) == hf_greedy(tiny_verifier, prompt, 24)
            stats = reply.stats
            assert stats.verifier_replica.startswith("in-process:") and stats.speculative_rounds > 0 and stats.verifier_state_bytes > 0
            # The verify call serializes nothing; the draft call still crosses gRPC. (Bytes, not hop
            # times: on 2 busy cores an in-process call's hand-off took as long as a loopback hop.)
            anatomy = stats.speculative_anatomy
            assert anatomy.verify_request_bytes == anatomy.verify_response_bytes == 0 < anatomy.draft_request_bytes, anatomy
        client.close()


@pytest.mark.slow  # 50 s; a head changes the drafts, not their verification (sampled in CI by test_services.py)
def test_sampling_through_the_feature_head_follows_the_verifier(feature_stack, tiny_verifier):
    """Power: a TVD of 0.046 (mass moved between the two likeliest cells) is caught half the
    time over its 1,500 draws (tests/stats.py detectable_tvd)."""
    # Three tokens: the first comes from the verifier (it brings the prompt's features), the
    # second is drafted by the head and accepted or corrected by rejection sampling.
    sampled_first_two_tokens(feature_stack, tiny_verifier, draws=1500, max_new_tokens=3)


def test_verifier_only_requests_ask_for_no_features(feature_stack):
    client = CoordinatorClient(feature_stack["coordinator"])
    reply = client.generate(generate_request(prompt_token_ids=[1, 4], max_new_tokens=5, num_draft_tokens=0))
    assert not reply.stats.verifier_state and reply.stats.verifier_state_bytes == 0
    client.close()


def test_a_feature_head_needs_a_verifier_that_sends_features(tiny_dirs, head_dir, feature_stack):
    with local_stack(tiny_config(tiny_dirs)) as plain:
        with pytest.raises(PairMismatch, match="reads verifier state 'feature-head features.*but the verifier fills none"):
            service_pair(feature_stack["drafter"], plain["verifier"])


def test_the_coordinator_keeps_verifier_state_by_position_unread():
    log = VerifierStateLog()
    log.add(common_pb2.VerifierState(start=0, positions=3, records=b"aabbcc"))
    assert log.unsent(3, reopen=False) == common_pb2.VerifierState(start=0, positions=3, records=b"aabbcc")
    log.delivered(3)
    log.add(common_pb2.VerifierState(start=3, positions=2, records=b"ddee"))
    assert log.unsent(log.positions, reopen=False).records == b"ddee" and log.unsent(3, reopen=False) is None
    assert log.unsent(5, reopen=True).records == b"aabbccddee"  # a re-opened drafter session gets it all
    # A re-opened verifier sends again from where it restarted: what follows is replaced, and
    # the drafter is sent it again.
    log.delivered(5)
    log.add(common_pb2.VerifierState(start=2, positions=2, records=b"CCDD"))
    assert (log.positions, log.drafter_holds, log.unsent(4, reopen=False).records) == (4, 2, b"CCDD")
    for bad in (
        common_pb2.VerifierState(start=6, positions=1, records=b"ff"),  # a gap
        common_pb2.VerifierState(start=4, positions=2, records=b"fff"),  # not whole records
        common_pb2.VerifierState(start=4, positions=1, records=b"fff"),  # another record size
    ):
        with pytest.raises(RuntimeError, match="malformed verifier state"):
            log.add(bad)


def test_bad_features_are_refused(feature_stack, tiny_dirs):
    drafter = MeasuredClient(feature_stack["drafter"], DRAFTER_SERVICE)
    start = common_pb2.SessionStart(context_token_ids=[1, 4, 5], sampling=common_pb2.SamplingParams())

    def draft(positions: int, records: bytes, start: int = 0) -> grpc.RpcError:
        request = drafter_pb2.DraftRequest(
            session_id="bad", start=start_session, committed_length=3, num_draft_tokens=2,
            verifier_state=common_pb2.VerifierState(start=start, positions=positions, records=records),
        )
        with pytest.raises(grpc.RpcError) as caught:
            drafter.call("Draft", request, drafter_pb2.DraftResponse)
        return caught.value

    start_session = start
    wrong_width = draft(2, bytes(2 * 31 * 2))
    assert wrong_width.code() == grpc.StatusCode.INVALID_ARGUMENT and "features of width 32" in wrong_width.details()
    short = draft(2, bytes(10))
    assert short.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in short.details()
    not_finite = draft(1, b"\xff\x7f" * 32)  # float16 NaN
    assert not_finite.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in not_finite.details()
    gap = draft(2, bytes(2 * 32 * 2), start=5)
    assert gap.code() == grpc.StatusCode.FAILED_PRECONDITION and "gap" in gap.details()
    missing = draft(1, bytes(32 * 2))
    assert missing.code() == grpc.StatusCode.FAILED_PRECONDITION and "features" in missing.details()
    drafter.close()
    with local_stack(tiny_config(tiny_dirs)) as plain:
        verifier = MeasuredClient(plain["verifier"], VERIFIER_SERVICE)
        request = verifier_pb2.VerifyRequest(session_id="v", round=1, start=start, verifier_state=True)
        with pytest.raises(grpc.RpcError) as caught:
            verifier.call("Verify", request, verifier_pb2.VerifyResponse)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature head" in caught.value.details()
        model_drafter = MeasuredClient(plain["drafter"], DRAFTER_SERVICE)
        request = drafter_pb2.DraftRequest(
            session_id="m", start=start, committed_length=3, num_draft_tokens=2,
            verifier_state=common_pb2.VerifierState(start=0, positions=2, records=bytes(128)),
        )
        with pytest.raises(grpc.RpcError) as caught:
            model_drafter.call("Draft", request, drafter_pb2.DraftResponse)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "this drafter reads none" in caught.value.details()
        verifier.close()
        model_drafter.close()


def tiny_recipe(tiny_dirs, prompts: Path, out: Path, vocab_dir: Path, **overrides) -> FeatureHeadConfig:
    base = dict(
        verifier=str(tiny_dirs["verifier"]), verifier_dtype="float32", draft_vocab_from=str(vocab_dir), layers=LAYERS,
        prompts=str(prompts), sample_tokens=12, samples_per_prompt=2, target_top_k=8, unroll=3, batch_size=8, steps=80,
        lr=3e-3, eval_prompts=12, eval_tokens=12, checkpoint_every=20, out=str(out), dtype="float32",
    )
    base.update(overrides)
    return parse(FeatureHeadConfig, base)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vocab")
    (path / "draft_vocab.json").write_text(json.dumps(VOCAB))
    return path


def test_short_training_aligns_the_head_and_serves_exactly(tiny_dirs, tiny_prompts, vocab_dir, tmp_path, tiny_verifier):  # noqa: F811
    report = run_feature_head(tiny_recipe(tiny_dirs, tiny_prompts, tmp_path / "run", vocab_dir))
    before, after = report["before"], report["after"]
    assert after["accepted_per_chain3_round"] > before["accepted_per_chain3_round"]
    assert after["greedy_agreement_by_depth"][0] > before["greedy_agreement_by_depth"][0] + 0.05
    assert sum(after["acceptance_t1_by_depth"]) > sum(before["acceptance_t1_by_depth"])
    losses = [h["loss"] for h in report["history"]]
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])
    assert set(report["train_question_ids"]).isdisjoint(report["eval_question_ids"])
    with local_stack(_config(tiny_dirs, report["feature_head_dir"])) as stack:
        client = CoordinatorClient(stack["coordinator"])
        accepted = 0
        for prompt in ([1, 4, 5], [1, 9], [3, 3, 8, 12]):
            reply = client.generate(generate_request(prompt_token_ids=prompt, max_new_tokens=30))
            assert list(reply.token_ids) == hf_greedy(tiny_verifier, prompt, 30)
            accepted += reply.stats.accepted_draft_tokens
        assert accepted > 0
        client.close()


def test_training_resumes_after_a_kill(tiny_dirs, tiny_prompts, vocab_dir, tmp_path):  # noqa: F811
    cfg = tiny_recipe(tiny_dirs, tiny_prompts, tmp_path / "run", vocab_dir, steps=300, checkpoint_every=5)
    assert_resumes_after_kill("distill-feature-head", cfg, tmp_path, 300)


def test_an_int8_head_drafts_like_the_float32_head(head_dir):
    """int8 weights (the head is memory-bound: about 3x faster drafts) change drafts at most
    near ties; verification, not the drafter, keeps the output exact."""
    context = [1, 4, 7, 3, 9, 5]
    features = VerifierState(**features_to_state(0, torch.randn(len(context) - 1, 32, generator=torch.Generator().manual_seed(1))))
    chains = []
    for dtype in ("float32", "int8"):
        drafter = drafter_for(ModelSpec(str(head_dir), dtype=dtype))
        session = drafter.open_session("s", context, Sampling(0.0, 1.0, 0, 0), "")
        tree = drafter.draft(session_id="s", session=session, new_tokens=[], committed_length=len(context), num_tokens=6,
                                 shape=TreeShape("dynamic", width=2), verifier_state=features).tree
        chains.append(tree)
    assert len(chains[1]) == 6 and chains[1].token_ids[0] == chains[0].token_ids[0]
    with pytest.raises(ValueError, match="float32 or int8"):
        drafter_for(ModelSpec(str(head_dir), dtype="bfloat16"))


def test_batched_samples_equal_the_one_at_a_time_path(tiny_dirs, tiny_verifier, vocab_dir):
    """The GPU data path (batched left-padded generate(), one teacher-forced pass per batch),
    run here on the CPU: the same continuations, depths and targets as the sequential engine."""
    from specdec.core.engine import TransformersEngine
    from specdec.core.models import eos_token_ids, load_tokenizer
    from specdec.train.distill_head import (
        _continue,
        _generate,
        _self_instruct,
        _teacher_pass,
        _text_chunks,
    )

    eos = eos_token_ids(tiny_verifier, load_tokenizer(str(tiny_dirs["verifier"])))
    prompts = [[1, 4, 5], [1, 9], [3, 3, 8, 12, 7, 2], [5]]
    runs = _generate(tiny_verifier, prompts, 10, eos, False, 3, "greedy")
    vocab = torch.tensor(VOCAB)
    batched = _teacher_pass(tiny_verifier, runs, LAYERS, vocab, 4, batch_tokens=20)
    by_text = {tuple(s.tokens.tolist()): s for s in batched}
    engine = TransformersEngine(tiny_verifier)
    for prompt, continuation in runs:
        assert continuation == hf_greedy(tiny_verifier, prompt, 10)[: len(continuation)]
        one = _continue(engine, prompt, 10, LAYERS, vocab, 4, set(eos), None)
        mine = by_text[tuple(prompt + continuation)]
        assert mine.tokens.tolist() == one.tokens.tolist() and mine.prompt_len == one.prompt_len
        torch.testing.assert_close(mine.hidden.float(), one.hidden.float(), atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(mine.target_probs.float(), one.target_probs.float(), atol=2e-3, rtol=1e-3)
    # A text read whole, cut in chunks as _read_text cuts it: each chunk trained on all but its last.
    text = _teacher_pass(tiny_verifier, [([1], [4, 5, 9, 3, 3, 8, 12, 7, 2, 6, 5])], LAYERS, vocab, 4)[0]
    pieces = _text_chunks(text, 5)
    starts = (0, 5)  # the 2 tokens from 10 on would train 1 position: _read_text drops such a tail too
    assert [p.tokens.tolist() for p in pieces] == [text.tokens[i : i + 5].tolist() for i in starts]
    for start, piece in zip(starts, pieces):
        assert torch.equal(piece.target_ids, text.target_ids[start : start + len(piece.tokens) - 1])
        assert torch.equal(piece.hidden, text.hidden[start : start + len(piece.tokens) - 1])
    # The verifier writes prompts of its own: the template's opening, its words, the assistant's turn.
    written = _self_instruct(tiny_verifier, load_tokenizer(str(tiny_dirs["verifier"])), 6, eos, 6)
    assert all(len(p) > 3 for p in written)
    # A position whose verifier puts no mass on the draft vocabulary pulls nowhere (no NaN).
    head = FeatureHead.from_verifier(tiny_verifier, LAYERS, VOCAB)
    silent = dataclasses.replace(batched[0], target_probs=torch.zeros_like(batched[0].target_probs))
    assert torch.isfinite(unrolled_loss(head, [silent, batched[1]], 3))


@pytest.mark.parametrize("drafter", ["head", "suffix"])
def test_cost_curve_times_the_verifier_where_the_drafter_is_no_causal_lm(tiny_dirs, head_dir, drafter):
    """A feature head is no causal LM of its own, an n-gram drafter has no model: the cost curve
    times the verifier engines (a row each per weight format asked for) and leaves the drafter's
    steps to the served bench."""
    from specdec.bench.cost import run_cost_curve
    from specdec.serving.config import config_from_dict

    source = str(head_dir) if drafter == "head" else drafter
    verifier = {"source": str(tiny_dirs["verifier"]), "dtype": "int8"}
    config = config_from_dict({"verifier": {"model": verifier}, "drafter": {"model": source}})
    rows = run_cost_curve(config, [1, 5, 7, 3, 9, 4], [1, 3], formats=["int8", "q4_1"], repeats=1)["results"]
    engines = ("served verifier (int8)", "served verifier (q4_1)", "float32 transformers verifier")
    assert {(r["engine"], r["tokens"]) for r in rows} == {(engine, k) for engine in engines for k in (1, 3)}
    assert all(r["model"] == "verifier" and r["verify_ms"] > 0 for r in rows)
    # each repetition's own T(k) / T(1): exactly 1 at k = 1, inside its interval everywhere
    assert all(r["paired_ratio_to_one_token"] == 1.0 for r in rows if r["tokens"] == 1)
    assert all(r["paired_interval"][0] <= r["paired_ratio_to_one_token"] <= r["paired_interval"][1] for r in rows)
