"""Sampled speculation through the real services at a realistic vocabulary: 2,048 tokens, so
the drafter's sparse proposals (`proposal_top_k` 32) truncate its distribution at every node,
with a drafter that is not the verifier (the verifier's weights perturbed: it agrees often,
never exactly). The joint distribution of the first tokens must be the verifier's own."""
from __future__ import annotations


import pytest
import torch

from specdec.core.models import ModelSpec, load_model
from specdec.core.sampling import Sampling, warp_probs
from specdec.v1 import common_pb2
from tests.conftest import local_stack, tiny_config
from tests.stats import assert_matches_distribution, check_sequences, detectable_tvd, exact_joint, sampled_through
from tests.tiny_models import build_model_dir, build_perturbed_copy

pytestmark = pytest.mark.slow  # 2-4 minutes each; the same verification at a small vocabulary runs in CI

VOCAB = 2048
EOS = 2
PROMPT = [1, 40, 900, 77]


@pytest.fixture(scope="module")
def large_vocab_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("large_vocab")
    words = ["<unk>", "<s>", "</s>"] + [f"v{i}" for i in range(VOCAB - 3)]
    # A narrower init than the 16-token models': flatter distributions, 40% of the mass outside a proposal.
    verifier = build_model_dir(root / "verifier", seed=5, words=words, width=64, init_range=0.3)
    return {"verifier": verifier, "drafter": build_perturbed_copy(verifier, root / "drafter", seed=6)}


@pytest.fixture(scope="module")
def large_vocab_stack(large_vocab_dirs):
    with local_stack(tiny_config(large_vocab_dirs)) as stack:
        yield stack


@pytest.fixture(scope="module")
def verifier(large_vocab_dirs):
    return load_model(ModelSpec(str(large_vocab_dirs["verifier"])))


def sampled_sequences(stack, draws: int, sampling: Sampling, length: int, **request) -> list[tuple[int, ...]]:
    return sampled_through(stack, PROMPT, draws, sampling, length, 0.25, **request)


def test_chains_at_full_temperature_follow_the_verifier(large_vocab_stack, verifier):
    """T = 1, no top-k or top-p: the whole 2,048-token vocabulary is possible while each
    proposal keeps 32 tokens. The marginal of each of the first two tokens (the second: a
    cell "ended" after EOS) over 3,000 draws: mass of TVD 0.039 (first token) or 0.018
    (second) moved between the two likeliest cells is caught half the time (detectable_tvd).
    A residual that drops the tokens outside a proposal measured TVD 0.5 here, and passes
    every 16-token test."""
    sampling, draws = Sampling(1.0), 3000
    sequences = sampled_sequences(large_vocab_stack, draws, sampling, 2, num_draft_tokens=2, tree=common_pb2.TreeShape(method="chain"))
    with torch.inference_mode():
        first = warp_probs(verifier(torch.tensor([PROMPT])).logits[0, -1], sampling)
        after = warp_probs(verifier(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1], sampling)
    ended = VOCAB  # the second position's cell for sequences that stopped at EOS
    second = torch.cat([(first[:, None] * after)[torch.arange(VOCAB) != EOS].sum(0), first[EOS].reshape(1)])
    for position, exact in ((0, first), (1, second)):
        counts = torch.zeros(len(exact))
        for seq in sequences:
            counts[seq[position] if position < len(seq) else ended] += 1
        assert_matches_distribution(counts, exact)
        assert detectable_tvd(draws, exact) < 0.05


def test_sampled_trees_with_top_k_and_top_p_follow_the_verifier(large_vocab_stack, verifier):
    """T = 0.8 with top-k 40 and top-p 0.9 through both services, 8-node trees whose siblings
    are drawn without replacement (rsd-c). Joint of the first three tokens (a two-level tree
    verification decides them) over 3,000 draws; TVD 0.030 caught half the time."""
    sampling, draws = Sampling(0.8, top_p=0.9, top_k=40), 3000
    tree = common_pb2.TreeShape(method="rsd-c", branching=[2, 2, 1])
    sequences = sampled_sequences(large_vocab_stack, draws, sampling, 3, num_draft_tokens=8, tree=tree)
    assert check_sequences(sequences, exact_joint(verifier, PROMPT, EOS, sampling, 3), draws) < 0.05
    assert len({seq[:1] for seq in sequences}) > 2 and all(len(seq) == 3 or EOS in seq for seq in sequences)


def test_proposals_are_truncated_at_this_scale(large_vocab_dirs):
    """The premise of the tests above: the drafter's warped distribution puts real mass outside
    the 32 tokens a proposal carries."""
    drafter = load_model(ModelSpec(str(large_vocab_dirs["drafter"])))
    with torch.inference_mode():
        probs = warp_probs(drafter(torch.tensor([PROMPT])).logits[0, -1], Sampling(1.0))
    outside = 1 - float(torch.topk(probs, 32).values.sum())
    assert outside > 0.1, f"only {outside:.3f} of the mass lies outside the proposal"
    assert probs.shape == (VOCAB,)
