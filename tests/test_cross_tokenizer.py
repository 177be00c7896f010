"""Drafting across tokenizers (drafter.tokenizer: own), with two real tokenizers at their real
vocabulary sizes: Qwen2.5's (151,665 tokens, the verifier's) and SmolLM2's (49,152, the
drafter's). The mapping alone on real text, then both services: greedy output equal to the
verifier alone's, sampled output distributed as the verifier's own, and the refusals."""
from __future__ import annotations

import random

import grpc
import pytest
from transformers import AutoTokenizer

from coordinator.clients import PairMismatch
from drafter_service.tokenizer_bridge import FollowedText, TokenizerBridge
from specdec.core.models import ModelSpec, hf_greedy, load_model, load_tokenizer
from specdec.core.sampling import Sampling
from specdec.core.tree import ROOT, DraftTree
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import ConfigError, config_from_dict
from specdec.v1 import common_pb2
from tests.conftest import local_stack
from tests.stats import check_sequences, exact_joint, sampled_through
from tests.tiny_models import build_text_model_dir, qwen_tokenizer_dir

# The texts both tiny models say (tokenized differently by the two tokenizers: '_total' is one
# Qwen token and two of SmolLM2's, '\n   ' the other way round), the likeliest first.
STRINGS = [" result", "_total", "(self", "\n   ", " =", " None", "(x)", " return", "):", "<|im_end|>"]
ANSWER = (
    'Here it is:\n\n```python\ndef is_prime(n: int) -> bool:\n    """True if n is prime. ✓ 日本語"""\n    if n < 2:\n'
    "        return False\n    for i in range(2, int(n ** 0.5) + 1):\n        if n % i == 0:\n            return False\n"
    "    return True\n```<|im_end|>"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(the drafter's own, the verifier's)"""
    return load_tokenizer("smollm2-135m-instruct"), AutoTokenizer.from_pretrained(qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def bridge(tokenizers):
    return TokenizerBridge(*tokenizers)


def chat(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False)


def test_followed_text_is_the_drafters_own_encoding(bridge, tokenizers):
    """Committed verifier tokens arriving a few at a time (characters split across tokens
    included) always leave the drafter holding exactly its own encoding of the text, and a
    context cut back (a wrong assumption) too; re-encoding changes the drafter's last tokens
    now and then, which is counted."""
    own, verifier = tokenizers
    context = chat(verifier, "Is 97 prime? ünïcödé")
    answer = verifier.encode(ANSWER, add_special_tokens=False)
    state, rng, at = FollowedText(), random.Random(0), 0
    for step in range(200):
        if at == len(answer):
            break
        at = min(len(answer), at + rng.randint(1, 5))
        tokens = bridge.follow(state, context + answer[:at])
        text = verifier.decode(context + answer[:at], skip_special_tokens=False).rstrip("\ufffd")
        assert state.text == text
        assert tokens == own.encode(text, add_special_tokens=False), f"step {step}"
    assert at == len(answer) and state.rollbacks > 0
    tokens = bridge.follow(state, context + answer[:-9])
    text = verifier.decode(context + answer[:-9], skip_special_tokens=False).rstrip("\ufffd")
    assert tokens == own.encode(text, add_special_tokens=False)


def own_continuation(bridge, state: FollowedText, text: str) -> list[int]:
    """The drafter's tokens for `text` after the followed context (where its encoding would
    merge with the context's last token, the tokens of `text` alone, as a drafter would go on)."""
    whole = bridge.own.encode(state.text + text, add_special_tokens=False)
    if whole[: len(state.own_tokens)] == state.own_tokens:
        return whole[len(state.own_tokens) :]
    return bridge.own.encode(text, add_special_tokens=False)


def test_a_right_draft_maps_to_the_verifiers_own_tokens(bridge, tokenizers):
    """A chain of the drafter's tokens for the text the verifier goes on to write maps to a
    prefix of the verifier's own tokens for it (the last, maybe cut, token dropped), at every
    point of the answer."""
    own, verifier = tokenizers
    context = chat(verifier, "Is 97 prime?")
    answer = verifier.encode(ANSWER, add_special_tokens=False)
    state, mapped_tokens, points = FollowedText(), 0, range(0, len(answer) - 1, 3)
    for at in points:
        bridge.follow(state, context + answer[:at])
        rest = verifier.decode(answer[at:], skip_special_tokens=False)
        chain = own_continuation(bridge, state, rest)[:6]
        tree, unbounded = bridge.to_verifier(state, DraftTree(chain, list(range(-1, len(chain) - 1))), 16)
        assert tree.token_ids == answer[at : at + len(tree)] and tree.parent == list(range(-1, len(tree) - 1))
        assert not tree.proposals and unbounded == len(tree) + (tree.token_ids[-1] != verifier.eos_token_id)  # the dropped one counted
        mapped_tokens += len(tree)
    assert mapped_tokens > 3 * len(points)  # 6 drafter tokens keep more than 3 of the verifier's


def test_branches_that_say_the_same_text_merge(bridge, tokenizers):
    """Two branches whose texts give the same verifier tokens become one path; the trie keeps
    the budget (the drafter's earlier leaves first) and its children are distinct."""
    own, verifier = tokenizers
    state = FollowedText()
    bridge.follow(state, chat(verifier, "Sum the list."))
    split = own.encode(" result_total", add_special_tokens=False)  # ' result', '_', 'total'
    other = own.encode(" resulting value", add_special_tokens=False)
    tree = DraftTree()
    for tokens in (split, split[:1] + own.encode("_total", add_special_tokens=False), other):
        parent = ROOT
        for token in tokens:
            parent = tree.add(token, parent)
    mapped, unbounded = bridge.to_verifier(state, tree, 64)
    paths = {tuple(mapped.token_ids[n] for n in mapped.path_to(leaf)) for leaf in range(len(mapped)) if not mapped.children(leaf)}
    assert paths == {tuple(verifier.encode(text, add_special_tokens=False)) for text in (" result", " resulting")}
    for node in [ROOT, *range(len(mapped))]:
        children = [mapped.token_ids[c] for c in mapped.children(node)]
        assert len(children) == len(set(children))
    small, unbounded_small = bridge.to_verifier(state, tree, 1)
    assert len(small) == 1 and unbounded_small == unbounded


@pytest.fixture(scope="module")
def text_pair_dirs(tmp_path_factory, tokenizers):
    """A verifier (Qwen2, Qwen's tokenizer) and a drafter (Llama, SmolLM2's) that say the same
    few texts, each in its own tokens."""
    own, verifier = tokenizers
    root = tmp_path_factory.mktemp("text_pair")
    return {
        "verifier": build_text_model_dir(root / "verifier", verifier, STRINGS, seed=1, arch="qwen2"),
        "drafter": build_text_model_dir(root / "drafter", own, STRINGS, seed=2),
    }


def pair_config(dirs: dict, **drafter) -> dict:
    return {
        "verifier": {"model": str(dirs["verifier"]), "torch_threads": 1},
        "drafter": {"model": str(dirs["drafter"]), "torch_threads": 1, "tokenizer": "own", **drafter},
        "coordinator": {"num_draft_tokens": 4, "adaptive": {"enabled": False}},
    }


@pytest.fixture(scope="module")
def pair_stack(text_pair_dirs):
    with local_stack(pair_config(text_pair_dirs)) as stack:
        yield stack


def test_greedy_across_tokenizers_equals_the_verifier_alone(pair_stack, text_pair_dirs, tokenizers):
    """Chains and dynamic trees drafted in SmolLM2's tokens give exactly the verifier alone's
    greedy output (and transformers' generate()); some drafts are kept, some not, and the
    round stats count the drafter's own tokens beside the verifier tokens they became."""
    verifier_model = load_model(ModelSpec(str(text_pair_dirs["verifier"])))
    client = CoordinatorClient(pair_stack["coordinator"])
    try:
        for prompt in ("Write the function.", "Sum a list", "Fix this: x = None"):
            ids = chat(tokenizers[1], prompt)
            alone = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=40, num_draft_tokens=0))
            assert list(alone.token_ids) == hf_greedy(verifier_model, ids, 40)[: len(alone.token_ids)]
            for tree, budget in ((common_pb2.TreeShape(method="chain"), 4), (common_pb2.TreeShape(method="dynamic", width=2), 8)):
                answer = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=40, num_draft_tokens=budget, tree=tree))
                assert list(answer.token_ids) == list(alone.token_ids), (prompt, tree.method)
                stats = answer.stats
                assert stats.speculative_rounds > 0 and stats.draft_own_tokens > 0 and stats.drafted_tokens > 0
                assert stats.accepted_draft_tokens < stats.drafted_tokens
                assert stats.draft_mapping_ms > 0
        assert answer.stats.accepted_draft_tokens > 0
    finally:
        client.close()


@pytest.mark.parametrize(
    "sampling, tree, budget, draws",
    [
        pytest.param(Sampling(0.8, top_p=0.9, top_k=5), common_pb2.TreeShape(method="chain"), 3, 800, id="chain-top-k-top-p"),
        pytest.param(
            Sampling(1.0), common_pb2.TreeShape(method="rsd-c", branching=[2, 2, 1]), 6, 2000, id="tree-T1", marks=pytest.mark.slow
        ),
    ],
)
def test_sampling_across_tokenizers_follows_the_verifier(pair_stack, text_pair_dirs, tokenizers, sampling, tree, budget, draws):
    """The joint distribution of the first three tokens is the verifier's own (chi-square); the
    drafter's samples reach the verifier as point masses (its proposal is over another
    vocabulary), which recursive rejection accepts with p(x) each, siblings without
    replacement. A request costs 0.1-0.3 s here (151k-token distributions warped and sampled
    in both services), so CI runs chains with top-k and top-p at 800 draws, the slow set trees
    at T=1 with 2,000."""
    verifier_model = load_model(ModelSpec(str(text_pair_dirs["verifier"])))
    prompt = chat(tokenizers[1], "Write the function.")
    sequences = sampled_through(pair_stack, prompt, draws, sampling, 3, 0.1, num_draft_tokens=budget, tree=tree)
    joint = exact_joint(verifier_model, prompt, tokenizers[1].eos_token_id, sampling, 3)
    assert check_sequences(sequences, joint, draws) < 0.1
    assert len({seq[:1] for seq in sequences}) > 2


def test_another_tokenizer_is_refused_unless_the_config_says_own(text_pair_dirs):
    """Without drafter.tokenizer: own the pair check refuses the pair, naming the fix; own on a
    drafter without a model of its own is a config error."""
    from tests.conftest import plain_services, service_pair

    config = config_from_dict(pair_config(text_pair_dirs, tokenizer="shared"))
    with plain_services(config) as addresses, pytest.raises(PairMismatch, match="drafter.tokenizer: own"):
        service_pair(*addresses)
    with pytest.raises(ConfigError, match="drafter.tokenizer: own"):
        config_from_dict({"drafter": {"model": "prompt-lookup", "tokenizer": "own"}})


def test_a_session_naming_another_tokenizer_is_refused(pair_stack):
    """The drafter speaks the verifier's tokens: a caller naming another tokenizer gets
    INVALID_ARGUMENT, and the drafter goes on serving."""
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import DRAFTER_SERVICE
    from specdec.v1 import drafter_pb2

    client = MeasuredClient(pair_stack["drafter"], DRAFTER_SERVICE)
    try:
        request = drafter_pb2.DraftRequest(
            session_id="s", num_draft_tokens=2, committed_length=3, verifier_tokenizer_fingerprint="not-this-one",
            start=common_pb2.SessionStart(context_token_ids=[1, 2, 3]),
        )
        with pytest.raises(grpc.RpcError) as err:
            client.call("Draft", request, drafter_pb2.DraftResponse)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "drafter.tokenizer: own" in err.value.details()
        request.verifier_tokenizer_fingerprint = ""
        reply, _ = client.call("Draft", request, drafter_pb2.DraftResponse)
        assert reply.own_tokens_drafted > 0
    finally:
        client.close()
