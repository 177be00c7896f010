"""Draft trees: the builders on their own (shape, budget, exactness of the verification
they feed, checked over thousands of draws), property tests of the tree encoding, masks
and KV compaction, and every method through the real services against generate()."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma2Config, Gemma2ForCausalLM

from drafter_service.tree_builders import NextToken, builder_for
from specdec.core.batching import forwardless, run_alone
from specdec.core.engine import TransformersEngine
from specdec.core.kv_cache import KVCache, TransformersCache
from specdec.core.models import (
    ModelSpec,
    UnsupportedModel,
    check_tree_attention,
    hf_greedy,
    load_model,
)
from specdec.core.sampling import accept_greedy, accept_sampled
from specdec.core.tree import (
    ROOT,
    TREE_METHODS,
    DraftTree,
    Proposal,
    TreeShape,
    node_inputs,
    verification_inputs,
)
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.wire import (
    shape_from_proto,
    shape_to_proto,
    tree_from_proto,
    tree_to_proto,
)
from specdec.v1 import common_pb2
from tests.conftest import local_stack, tiny_config
from tests.stats import assert_matches_distribution
from tests.test_services import sampled_first_two_tokens
from tests.tiny_models import build_model_dir

VOCAB = 5
ROOT_TOKEN = 0


def markov(seed: int, sharpness: float) -> torch.Tensor:
    """A next-token table over a small vocabulary: row t is the distribution after token t."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * sharpness, dim=-1)


def table_expand(table: torch.Tensor, sampled: bool):
    """The drafter side of a builder without a model: the next-token distribution after a
    node is the table row of its token; sampled drafts carry the matching sparse proposal."""

    @forwardless
    def expand(tree: DraftTree, nodes: list[int]):
        out = []
        for node in nodes:
            probs = table[ROOT_TOKEN if node == ROOT else tree.token_ids[node]]
            proposal = Proposal(list(range(VOCAB)), probs.tolist()) if sampled else None
            out.append(NextToken(probs, None, proposal))
        return out

    return expand


def build(builder, expand, budget: int, rng) -> DraftTree:
    """A builder's tree with an expand that runs no forward."""
    return run_alone(builder.build(expand, budget, rng), forward_many=None)


SHAPES = {
    "chain": TreeShape("chain"),
    "static": TreeShape("static", branching=[3, 2]),
    "dynamic": TreeShape("dynamic", width=3, max_depth=3),
    "rsd-c": TreeShape("rsd-c", branching=[3, 2]),
    "rsd-s": TreeShape("rsd-s", width=3),
    "lattice": TreeShape("lattice", width=3, max_depth=3),
    "lattice-ngram": TreeShape("lattice-ngram", width=3, max_depth=3),
}
assert set(SHAPES) == set(TREE_METHODS)


def check_well_formed(tree: DraftTree, budget: int, vocab: int = VOCAB) -> None:
    tree.validate(vocab)
    assert 1 <= len(tree) <= budget
    for node in [ROOT, *range(len(tree))]:
        siblings = [tree.token_ids[c] for c in tree.children(node)]
        assert len(set(siblings)) == len(siblings), "siblings repeat a token"


@pytest.mark.parametrize("method", TREE_METHODS)
@pytest.mark.parametrize("budget", [1, 4, 9])
def test_builders_respect_budget_and_form(method, budget):
    draft = markov(0, 2.0)
    greedy_tree = build(builder_for(SHAPES[method]), table_expand(draft, False), budget, None)
    check_well_formed(greedy_tree, budget)
    assert not greedy_tree.proposals, "greedy drafts carry no proposals"
    sampled_tree = build(builder_for(SHAPES[method]), table_expand(draft, True), budget, torch.Generator().manual_seed(1))
    check_well_formed(sampled_tree, budget)
    if method in ("static", "dynamic"):
        assert not sampled_tree.proposals, "deterministic children are point-mass proposals"
    else:
        assert all(sampled_tree.children(n) for n in sampled_tree.proposals)
    if method in ("static", "rsd-c", "rsd-s") and budget >= 4:
        assert len(greedy_tree.children(ROOT)) == 3


def test_chain_and_static_shapes():
    draft = markov(0, 2.0)
    chain = build(builder_for(TreeShape("chain")), table_expand(draft, False), 4, None)
    assert chain.parent == [ROOT, 0, 1, 2]
    assert chain.token_ids[0] == int(draft[ROOT_TOKEN].argmax())
    static = build(builder_for(TreeShape("static", branching=[3, 2])), table_expand(draft, False), 9, None)
    # 3 children of the root, 2 under each, then chains of one
    assert static.depths() == [1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert static.token_ids[:3] == torch.topk(draft[ROOT_TOKEN], 3).indices.tolist()


def all_sequences_by_logprob(table: torch.Tensor, depth: int) -> dict[tuple, float]:
    out = {}
    for length in range(1, depth + 1):
        for seq in itertools.product(range(VOCAB), repeat=length):
            prev, logp = ROOT_TOKEN, 0.0
            for t in seq:
                logp += math.log(float(table[prev, t]))
                prev = t
            out[seq] = logp
    return out


def paths(tree: DraftTree) -> set[tuple]:
    return {tuple(tree.token_ids[n] for n in tree.path_to(node)) for node in range(len(tree))}


def test_dynamic_keeps_the_best_expanded_candidates():
    """With width >= vocabulary every sequence up to max_depth is a candidate, so the kept
    set must be exactly the `budget` likeliest sequences."""
    draft = markov(3, 2.0)
    tree = build(builder_for(TreeShape("dynamic", width=VOCAB, max_depth=2)), table_expand(draft, False), 7, None)
    scores = all_sequences_by_logprob(draft, 2)
    best = sorted(scores, key=lambda s: -scores[s])[:7]
    assert paths(tree) == set(best)


def test_rsd_s_without_noise_is_beam_search():
    draft = markov(4, 1.0)
    tree = build(builder_for(TreeShape("rsd-s", width=2)), table_expand(draft, False), 6, None)
    scores = all_sequences_by_logprob(draft, 3)
    beam = [()]
    for depth in range(1, 4):
        candidates = [b + (t,) for b in beam for t in range(VOCAB)]
        beam = sorted(candidates, key=lambda s: -scores[s])[:2]
        assert {p for p in paths(tree) if len(p) == depth} == set(beam)


def test_lattice_keeps_the_best_prefixes_of_the_chain_lattice_and_rescoring_moves_them():
    draft = markov(5, 1.0)
    calls = []

    def expand(tree, nodes):
        calls.append([tree.token_ids[n] for n in tree.path_to(nodes[0])] if nodes[0] != ROOT else [])
        return (yield from table_expand(draft, False)(tree, nodes))

    tree = build(builder_for(TreeShape("lattice", width=VOCAB, max_depth=3)), expand, 5, None)
    chain = calls[-1] + [int(draft[calls[-1][-1]].argmax())]
    assert calls == [chain[:0], chain[:1], chain[:2]]  # the drafter runs the chain only
    # Every token at depth d is scored by the distribution after the chain's token d - 1.
    logq = [draft[ROOT_TOKEN].log()] + [draft[t].log() for t in chain[:2]]
    scores = {
        seq: sum(float(logq[d][t]) for d, t in enumerate(seq))
        for length in (1, 2, 3) for seq in itertools.product(range(VOCAB), repeat=length)
    }
    assert paths(tree) == set(sorted(scores, key=lambda s: -scores[s])[:5])
    # A rescorer that likes token 0 everywhere pulls paths of zeros in.
    liked = builder_for(
        TreeShape("lattice-ngram", width=VOCAB, max_depth=3),
        rescore=lambda path, candidates: [logq + (0.0 if token == 0 else -20.0) for token, logq in candidates],
    )
    assert paths(build(liked, table_expand(draft, False), 3, None)) == {(0,), (0, 0), (0, 0, 0)}


@pytest.mark.parametrize("method", TREE_METHODS)
def test_tree_verification_is_exact_for_every_builder(method):
    """Draft a tree from one table, verify it against another with recursive rejection
    sampling, then continue from the target: the first three tokens must follow the
    target's joint distribution exactly (chi-square over 6,000 draws).
    Power: a TVD of 0.017 (mass moved between the two likeliest cells) is caught half the time
    over its 6,000 draws (tests/stats.py detectable_tvd)."""
    draft, target = markov(0, 1.5), markov(1, 1.5)
    builder = builder_for(SHAPES[method])
    rng = torch.Generator().manual_seed(7)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    accepted = 0
    for _ in range(6000):
        tree = build(builder, table_expand(draft, True), 8, rng)
        rows = torch.stack([target[ROOT_TOKEN]] + [target[t] for t in tree.token_ids])
        path, next_token = accept_sampled(tree, rows, rng)
        accepted += len(path)
        tokens = [tree.token_ids[n] for n in path] + [next_token]
        while len(tokens) < 3:
            tokens.append(int(torch.multinomial(target[tokens[-1]], 1, generator=rng)))
        counts[tokens[0], tokens[1], tokens[2]] += 1
    exact = target[ROOT_TOKEN][:, None, None] * target[:, :, None] * target[None, :, :]
    assert_matches_distribution(counts, exact)
    assert accepted / 6000 > 0.3  # the tree does get used


@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_acceptance_follows_the_target_argmax(method):
    draft, target = markov(0, 3.0), markov(0, 3.0) * 0.5 + markov(1, 3.0) * 0.5
    tree = build(builder_for(SHAPES[method]), table_expand(draft, False), 8, None)
    argmax = [int(target[ROOT_TOKEN].argmax())] + [int(target[t].argmax()) for t in tree.token_ids]
    path, next_token = accept_greedy(tree, argmax)
    tokens = [tree.token_ids[n] for n in path] + [next_token]
    prev = ROOT_TOKEN
    for t in tokens:
        assert t == int(target[prev].argmax())
        prev = t


# --- property tests: encoding, masks, compaction -------------------------------------------

@st.composite
def trees(draw, max_nodes: int = 24, vocab: int = 50):
    n = draw(st.integers(1, max_nodes))
    parent = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return DraftTree(tokens, parent)


@given(trees())
@settings(max_examples=200, deadline=None)
def test_tree_wire_round_trip_and_ancestry(tree):
    tree.validate(50)
    back = tree_from_proto(tree_to_proto(tree))
    assert (back.token_ids, back.parent, back.proposals) == (tree.token_ids, tree.parent, tree.proposals)
    mask = tree.ancestor_mask()
    for node in range(len(tree)):
        ancestors = set(tree.path_to(node))
        assert {j for j in range(len(tree)) if mask[node, j]} == ancestors
        assert tree.depths()[node] == len(ancestors)


@given(trees(), st.integers(1, 20), st.data())
@settings(max_examples=150, deadline=None)
def test_node_inputs_agree_with_one_pass_verification(tree, num_context, data):
    """Feeding nodes in any parents-first batches over a cache gives each node the same
    visible set and position as the verifier's single pass."""
    _, full_mask = verification_inputs(tree, num_context - 1, 1)
    full_positions, _ = verification_inputs(tree, num_context - 1, 1)
    order = list(range(len(tree)))
    cut = sorted(set(data.draw(st.lists(st.integers(1, len(tree)), max_size=3))))
    batches = [order[a:b] for a, b in zip([0, *cut], [*cut, len(tree)]) if a < b]
    cached: list[int] = []
    for batch in batches:
        positions, mask = node_inputs(tree, cached, batch, num_context)
        columns = list(range(num_context)) + [num_context + n for n in cached + batch]
        for row, node in enumerate(batch):
            assert positions[0, row] == full_positions[0, 1 + node]
            assert torch.equal(mask[0, 0, row], full_mask[0, 0, 1 + node, columns])
            # nothing outside these columns is visible in the one-pass mask either
            assert int(full_mask[0, 0, 1 + node].sum()) == int(mask[0, 0, row].sum())
        cached += batch


@given(trees(max_nodes=16), st.data())
@settings(max_examples=150, deadline=None)
def test_subtree_keeps_the_paths_of_kept_nodes(tree, data):
    node = data.draw(st.integers(0, len(tree) - 1))
    keep = sorted(set(tree.path_to(node)) | {n for n in range(len(tree)) if tree.parent[n] == ROOT})
    sub = tree.subtree(keep)
    sub.validate(50)
    assert paths(sub) == {tuple(tree.token_ids[m] for m in tree.path_to(n)) for n in keep}


@given(st.integers(0, 12), st.integers(0, 10), st.data())
@settings(max_examples=150, deadline=None)
def test_keep_positions_compacts_to_the_accepted_path(prefix, extra_len, data):
    """Both session caches (transformers' and the engine's preallocated one) keep exactly
    the committed prefix and the accepted path."""
    total = prefix + extra_len
    extra = sorted(data.draw(st.sets(st.integers(prefix, max(total - 1, prefix)), max_size=extra_len))) if extra_len else []
    keys = torch.arange(total, dtype=torch.float32).reshape(1, 1, total, 1).repeat(1, 2, 1, 3)
    dynamic = TransformersCache()
    static = KVCache(num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu", capacity=4)
    static.reserve(total)
    for layer in range(2):
        dynamic.update(keys + 100 * layer, -keys, layer)
        static.keys[layer, :, :total], static.values[layer, :, :total] = keys[0] + 100 * layer, -keys[0]
    static.length = total
    expected = list(range(prefix)) + extra
    for cache in (dynamic, static):
        cache.keep_positions(prefix, extra)
        assert cache.get_seq_length() == len(expected)
    for layer, cached in enumerate(dynamic.layers):
        for layer_keys, layer_values in ((cached.keys[0], cached.values[0]), (static.keys[layer], static.values[layer])):
            assert layer_keys[0, : len(expected), 0].tolist() == [float(p + 100 * layer) for p in expected]
            assert layer_values[1, : len(expected), 2].tolist() == [-float(p) for p in expected]


def test_tree_shape_wire_and_validation():
    shape = TreeShape("rsd-c", branching=[4, 2], width=3, max_depth=5)
    assert shape_from_proto(shape_to_proto(shape)) == shape
    for bad, message in [
        ({"method": "beam"}, "method must be one of"),
        ({"method": "static", "branching": []}, "branching"),
        ({"method": "static", "branching": [2, 0]}, "branching"),
        ({"method": "dynamic", "width": 0}, "width"),
        ({"method": "dynamic", "max_depth": -1}, "max_depth"),
        ({"method": "dynamic", "ngram": "bigram"}, "ngram must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            TreeShape(**bad)
    for past_cap, message in [
        (TreeShape("static", branching=[2] * 9), "branching must list 1 to 8"),
        (TreeShape("static", branching=[9]), r"integers in \[1, 8\]"),
        (TreeShape("dynamic", width=9), r"width must be in \[1, 8\]"),
        (TreeShape("dynamic", max_depth=9), r"max_depth must be in \[0, 8\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            past_cap.check_limit(8)
    TreeShape("static", branching=[8] * 8, width=8, max_depth=8).check_limit(8)


# --- every method through the real services -------------------------------------------------

SERVICE_PROMPTS = [[1, 3, 4, 5], [1, 7], [1, 4, 4, 9, 12, 0], [1, 11, 3, 8, 8, 2, 5, 6]]


def tree_request(method: str) -> common_pb2.TreeShape:
    return shape_to_proto(SHAPES[method])


@pytest.fixture(scope="module")
def tree_stack(tiny_dirs):
    with local_stack(tiny_config(tiny_dirs)) as stack:
        stack["client"] = CoordinatorClient(stack["coordinator"])
        yield stack
        stack["client"].close()


@pytest.mark.parametrize("method", TREE_METHODS)
@pytest.mark.parametrize("budget", [8, 16])
def test_greedy_trees_are_token_identical_to_generate(tree_stack, tiny_verifier, method, budget):
    for ids in SERVICE_PROMPTS:
        response = tree_stack["client"].generate(
            generate_request(prompt_token_ids=ids, max_new_tokens=40, num_draft_tokens=budget, tree=tree_request(method))
        )
        assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40), (method, ids)
        stats = response.stats
        assert stats.tree_method == method and stats.speculation_budget == budget
        assert stats.drafted_tokens <= budget * stats.rounds
        assert stats.bytes_per_round == pytest.approx((stats.bytes_sent + stats.bytes_received) / stats.rounds)


def test_trees_accept_more_than_a_chain_of_the_same_budget(tree_stack):
    def accepted(method: str) -> float:
        totals = [0, 0]
        for ids in SERVICE_PROMPTS:
            stats = tree_stack["client"].generate(
                generate_request(prompt_token_ids=ids, max_new_tokens=40, num_draft_tokens=8, tree=tree_request(method))
            ).stats
            totals[0] += stats.accepted_draft_tokens
            totals[1] += stats.rounds
        return totals[0] / totals[1]

    chain = accepted("chain")
    assert max(accepted(m) for m in ("static", "dynamic", "rsd-s")) > chain


def test_a_lattice_left_without_a_depth_drafts_half_its_budget_deep(tree_stack):
    """Through the services a request that sets no max_depth leaves the depth to the tree
    builder: a lattice of 8 nodes drafts a 4-deep chain, 4 drafter forwards a round instead of
    8 (the last rounds, where fewer tokens are left than the budget, are capped by those)."""
    for method in ("lattice", "lattice-ngram"):
        stats = tree_stack["client"].generate(
            generate_request(
                prompt_token_ids=SERVICE_PROMPTS[0], max_new_tokens=40, num_draft_tokens=8, tree=shape_to_proto(TreeShape(method))
            )
        ).stats
        assert stats.speculative_rounds and stats.draft_forward_passes < 5 * stats.speculative_rounds, method


# Statistical runs take ~90 s each: CI samples rsd-s, the most involved verification (recursive
# rejection without replacement over sampled siblings); chains sample through the services in
# test_services.py and point-mass children (dynamic, static, the lattices) across tokenizers in
# test_cross_tokenizer.py. The rest run in the slow set; every method's greedy exactness in the fast one.
SAMPLED_IN_THE_SLOW_SET = ("chain", "static", "dynamic", "rsd-c", "lattice", "lattice-ngram")


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.slow) if m in SAMPLED_IN_THE_SLOW_SET else m for m in TREE_METHODS]
)
def test_sampled_trees_follow_the_verifier_distribution(tree_stack, tiny_verifier, method):
    """max_new_tokens=3 lets the first round draft two levels, so the first two tokens come
    out of a real two-level tree verification.
    Power: a TVD of 0.041 (mass moved between the two likeliest cells) is caught half the time
    over its 2,000 draws (tests/stats.py detectable_tvd)."""
    sampled_first_two_tokens(tree_stack, tiny_verifier, draws=2000, max_new_tokens=3, num_draft_tokens=8, tree=tree_request(method))


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_other_architectures_verify_trees_exactly(tmp_path, arch):
    verifier = build_model_dir(tmp_path / "verifier", seed=1, arch=arch)
    drafter = build_model_dir(tmp_path / "drafter", seed=2, layers=1, arch=arch)
    config = {"verifier": {"model": str(verifier), "torch_threads": 1}, "drafter": {"model": str(drafter), "torch_threads": 1}}
    model = load_model(ModelSpec(str(verifier)))
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        for method in ("dynamic", "rsd-s"):
            for ids in SERVICE_PROMPTS[:2]:
                response = client.generate(
                    generate_request(prompt_token_ids=ids, max_new_tokens=30, num_draft_tokens=12, tree=tree_request(method))
                )
                assert list(response.token_ids) == hf_greedy(model, ids, 30), (arch, method)
        client.close()


def test_architectures_that_ignore_tree_masks_are_refused():
    config = Gemma2Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    )
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModel, match="'gemma2' does not honour a custom 4-D attention mask"):
        check_tree_attention(TransformersEngine(Gemma2ForCausalLM(config).eval()), config)


@pytest.mark.parametrize("sampling", [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 5)])
def test_a_reduced_vocabulary_gives_the_distribution_the_full_one_gives(sampling):
    """A drafter whose head covers a draft vocabulary (the logits of those tokens alone)
    normalises over that vocabulary: the same probabilities and the same top tokens as a
    full-vocabulary head with -inf logits elsewhere, and for sampling the same sparse proposal."""
    from drafter_service.distributions import next_tokens
    from specdec.core.sampling import Sampling

    vocab_size, support = 500, torch.tensor(sorted(torch.randperm(500, generator=torch.Generator().manual_seed(3))[:60].tolist()))
    logits = torch.full((vocab_size,), float("-inf"))
    logits[support] = torch.randn(len(support), generator=torch.Generator().manual_seed(4)) * 3
    settings_ = Sampling(*sampling)
    dists = []
    for draft_vocab, rows in ((None, logits), (support, logits[support])):
        dists.append(next_tokens(rows[None], settings_, draft_vocab, 16)[0])
    full, reduced = dists
    full_tokens, full_probs = full.possible()
    reduced_tokens, reduced_probs = reduced.possible()
    order = [reduced_tokens.tolist().index(t) for t in full_tokens.tolist()]
    assert sorted(full_tokens.tolist()) == sorted(reduced_tokens.tolist()) and set(full_tokens.tolist()) <= set(support.tolist())
    torch.testing.assert_close(reduced_probs[order], full_probs, rtol=1e-12, atol=1e-15)
    assert [t for t, _ in reduced.top(8)] == [t for t, _ in full.top(8)]
    assert [p for _, p in reduced.top(8)] == pytest.approx([p for _, p in full.top(8)], rel=1e-12)
    if not settings_.greedy:
        assert reduced.proposal.token_ids == full.proposal.token_ids
        assert reduced.proposal.probs == pytest.approx(full.proposal.probs, rel=1e-6)
