"""The verification math on its own: warping, greedy acceptance, and exactness of recursive
rejection sampling (chain, point-mass children, children drawn without replacement)."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.core.sampling import (
    Sampling,
    accept_greedy,
    accept_sampled,
    greedy_tokens,
    validate_sampling,
    warp_probs,
)
from specdec.core.tree import ROOT, DraftTree, Proposal
from tests.stats import assert_matches_distribution


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6), (1.0, 1, 1.0)])
def test_warp_probs_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = warp_probs(logits, Sampling(temperature, top_p, top_k))
    assert torch.allclose(got, expected.double().softmax(-1), atol=1e-9)


@pytest.mark.parametrize(
    "temperature,top_p,top_k,field",
    [
        (-0.1, 1.0, 0, "temperature"), (float("nan"), 1.0, 0, "temperature"), (1.0, 0.0, 0, "top_p"), (1.0, 1.5, 0, "top_p"),
        (1.0, 1.0, -1, "top_k"),
    ],
)
def test_validate_sampling_names_the_field(temperature, top_p, top_k, field):
    with pytest.raises(ValueError, match=field):
        validate_sampling(temperature, top_p, top_k)


def test_greedy_accepts_longest_matching_path():
    # root -> a(5) -> b(6) -> c(7);  root -> d(8) -> e(9)
    tree = DraftTree([5, 6, 7, 8, 9], [ROOT, 0, 1, ROOT, 3])
    # verifier argmax after: root, a, b, c, d, e
    assert accept_greedy(tree, [8, 1, 1, 1, 9, 4]) == ([3, 4], 4)  # second branch, then bonus 4
    assert accept_greedy(tree, [5, 6, 3, 0, 0, 0]) == ([0, 1], 3)  # correction after b
    assert accept_greedy(tree, [5, 6, 7, 2, 0, 0]) == ([0, 1, 2], 2)  # all accepted + bonus
    assert accept_greedy(tree, [1, 0, 0, 0, 0, 0]) == ([], 1)  # nothing accepted
    assert accept_greedy(DraftTree(), [4]) == ([], 4)


def _first_two_tokens(tree: DraftTree, generator: torch.Generator) -> tuple[int, int]:
    """The first two output tokens of one verification. After a rejection or a leaf, the
    second token comes from the verifier's distribution after the first, _NEXT[first]."""
    path, nxt = accept_sampled(tree, _targets(tree), generator)
    tokens = [tree.token_ids[n] for n in path] + [nxt]
    if len(tokens) < 2:
        tokens.append(int(torch.multinomial(_NEXT[tokens[0]], 1, generator=generator)))
    return tokens[0], tokens[1]


VOCAB = 6
torch.manual_seed(1)
_P0 = torch.softmax(torch.randn(VOCAB) * 1.5, -1).double()
_NEXT = torch.softmax(torch.randn(VOCAB, VOCAB) * 1.5, -1).double()  # verifier after each token
_Q0 = torch.softmax(torch.randn(VOCAB) * 1.5, -1).double()
_QNEXT = torch.softmax(torch.randn(VOCAB, VOCAB) * 1.5, -1).double()
EXACT = _P0[:, None] * _NEXT  # the verifier's own joint distribution of two tokens


def _proposal(q: torch.Tensor) -> Proposal:
    return Proposal(list(range(VOCAB)), q.float().tolist())


def _targets(tree: DraftTree) -> torch.Tensor:
    return torch.stack([_P0] + [_NEXT[t] for t in tree.token_ids])


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_sampling_is_exact(seed):
    """Leviathan/Chen on a 2-token chain drawn from q: residual and bonus tokens included.
    Power: a TVD of 0.018 (mass moved between the two likeliest cells) is caught half the time
    over its 6,000 draws (tests/stats.py detectable_tvd)."""
    generator = torch.Generator().manual_seed(100 + seed)
    draws = 6000
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        x1 = int(torch.multinomial(_Q0, 1, generator=generator))
        x2 = int(torch.multinomial(_QNEXT[x1], 1, generator=generator))
        tree = DraftTree([x1, x2], [ROOT, 0], {ROOT: _proposal(_Q0), 0: _proposal(_QNEXT[x1])})
        counts[_first_two_tokens(tree, generator)] += 1
    assert_matches_distribution(counts.flatten(), EXACT.flatten())


def test_tree_without_replacement_is_exact():
    """Three root children drawn from q without replacement (Gumbel-top-k), each with one
    sampled child: the RSD residual rule must reproduce the verifier's joint distribution.
    Power: a TVD of 0.018 (mass moved between the two likeliest cells) is caught half the time
    over its 6,000 draws (tests/stats.py detectable_tvd)."""
    generator = torch.Generator().manual_seed(7)
    draws = 6000
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(draws):
        gumbel = -torch.log(-torch.log(torch.rand(VOCAB, generator=generator, dtype=torch.float64)))
        firsts = torch.topk(_Q0.log() + gumbel, 3).indices.tolist()
        seconds = [int(torch.multinomial(_QNEXT[x], 1, generator=generator)) for x in firsts]
        tree = DraftTree(
            firsts + seconds,
            [ROOT, ROOT, ROOT, 0, 1, 2],
            {ROOT: _proposal(_Q0), **{i: _proposal(_QNEXT[x]) for i, x in enumerate(firsts)}},
        )
        counts[_first_two_tokens(tree, generator)] += 1
    assert_matches_distribution(counts.flatten(), EXACT.flatten())


def test_point_mass_children_are_exact():
    """Deterministic top-3 children (EAGLE-style): accept with p(x), else remove x from p.
    Power: a TVD of 0.018 (mass moved between the two likeliest cells) is caught half the time
    over its 6,000 draws (tests/stats.py detectable_tvd)."""
    firsts = torch.topk(_Q0, 3).indices.tolist()
    tree = DraftTree(firsts, [ROOT] * 3)
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(6000):
        counts[_first_two_tokens(tree, generator)] += 1
    assert_matches_distribution(counts.flatten(), EXACT.flatten())


def test_acceptance_rate_equals_one_minus_tvd():
    """A one-token chain is accepted with probability sum(min(p, q)) = 1 - TVD(p, q)."""
    generator = torch.Generator().manual_seed(11)
    draws, accepted = 20000, 0
    for _ in range(draws):
        x = int(torch.multinomial(_Q0, 1, generator=generator))
        tree = DraftTree([x], [ROOT], {ROOT: _proposal(_Q0)})
        path, _ = accept_sampled(tree, _targets(tree), generator)
        accepted += len(path)
    expected = float(torch.minimum(_P0, _Q0).sum())
    assert abs(accepted / draws - expected) < 4 * (expected * (1 - expected) / draws) ** 0.5


def test_identical_draft_is_always_accepted():
    generator = torch.Generator().manual_seed(0)
    for x, y in itertools.product(range(VOCAB), range(VOCAB)):
        tree = DraftTree([x, y], [ROOT, 0], {ROOT: _proposal(_P0), 0: _proposal(_NEXT[x])})
        path, _ = accept_sampled(tree, _targets(tree), generator)
        assert path == [0, 1]


def test_greedy_tokens_are_torch_argmax_first_of_ties():
    """The vectorized CPU argmax picks what torch's argmax picks, ties included (the first)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(17, 49152, generator=generator)
    logits[3, [5, 9000, 40000]] = 1e3  # tied maxima: the first wins
    logits[8] = 0.0  # all tied
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits)[3] == 5 and greedy_tokens(logits)[8] == 0
    assert greedy_tokens(logits[4]) == [int(logits[4].argmax())]  # one row, 1-D
    assert greedy_tokens(logits.to(torch.bfloat16)) == logits.to(torch.bfloat16).argmax(dim=-1).tolist()
