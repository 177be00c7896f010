"""Drafting without a model: prompt lookup and suffix decoding (pure), the n-gram drafter
service with no model, and hybrid drafts (model + n-gram) — exact through the services."""
from __future__ import annotations

import pytest

from specdec.core.models import hf_greedy
from specdec.core.ngram import (
    NgramIndex,
    NgramProposer,
    NgramSettings,
    OwnChoices,
    RecentOutputs,
    continuation_tree,
    merge_trees,
)
from specdec.core.tree import ROOT, DraftTree
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import ConfigError, config_from_dict
from tests.conftest import local_stack, tiny_config
from tests.test_services import sampled_first_two_tokens


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of the tree."""
    return {tuple(tree.token_ids[n] for n in tree.path_to(node)) for node in range(len(tree))}


def test_index_finds_earlier_occurrences_with_a_continuation():
    index = NgramIndex(3, [5, 6, 7, 5, 6, 8, 5, 6])
    assert index.continued((5, 6)) == [4, 1]  # latest first; the final (5, 6) has no continuation
    assert index.continuation(4, 3) == [8, 5, 6]
    index.extend([9])
    assert index.continued((5, 6)) == [7, 4, 1]


def test_prompt_lookup_follows_the_latest_longest_match():
    proposer = NgramProposer("prompt-lookup", NgramSettings(max_ngram=3, min_ngram=1))
    context = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    tree = proposer.propose(proposer.new_index(context), context, budget=3).tree
    # (1, 2, 3) occurs once before: its continuation wins over the later (2, 3) -> 5.
    assert tree.token_ids == [4, 9, 2] and tree.parent == [ROOT, 0, 1]
    assert proposer.propose(proposer.new_index(context), context, budget=5, max_depth=2).tree.token_ids == [4, 9]


def test_no_match_below_min_ngram_drafts_nothing():
    proposer = NgramProposer("prompt-lookup", NgramSettings(min_ngram=2))
    context = [1, 2, 3, 1]  # only the 1-gram (1) repeats
    assert len(proposer.propose(proposer.new_index(context), context, budget=4)) == 0
    loose = NgramProposer("prompt-lookup", NgramSettings(min_ngram=1))
    assert loose.propose(loose.new_index(context), context, budget=2).tree.token_ids == [2, 3]


def test_suffix_tree_is_scored_by_how_often_each_continuation_occurred():
    tree, shares = continuation_tree([[7, 8], [7, 9], [7, 8], [4]], budget=3, min_share=0.0)
    assert paths(tree) == {(7,), (7, 8), (7, 9)}  # (4,) occurred once, as (7, 9) did: the earlier wins
    assert shares == [0.75, 0.5, 0.25]  # nodes (7,), (7, 8), (7, 9): the share of occurrences through each
    assert paths(continuation_tree([[7, 8], [7, 9], [7, 8], [4]], budget=10, min_share=0.5)[0]) == {(7,), (7, 8)}


def test_confidence_learns_that_long_matches_are_copied():
    proposer = NgramProposer("prompt-lookup", NgramSettings(max_ngram=2, min_ngram=1))
    context = [1, 2, 3, 4, 5, 6, 9, 2]
    draft = proposer.propose(proposer.new_index(context), context, budget=4)
    assert draft.tree.token_ids == [3, 4, 5, 6] and draft.matched == 1
    assert draft.confidence == pytest.approx([0.5, 0.25, 0.125, 0.0625])  # the uniform prior
    for _ in range(20):  # after one matched token the first draft token is rejected; after two or more, copied
        proposer.learn(draft, [7])
        proposer.learn(draft, [3, 4, 5, 6])
    p1, p2 = proposer.acceptance.probability(1), proposer.acceptance.probability(2)
    assert p1 == pytest.approx(21 / 42) and p2 == pytest.approx(21 / 22)
    again = proposer.propose(proposer.new_index(context), context, budget=4).confidence
    assert again[0] == pytest.approx(p1) and again[1] == pytest.approx(p1 * p2)
    assert all(child <= parent for parent, child in zip(again, again[1:]))


def test_suffix_draft_depth_follows_the_match_length():
    proposer = NgramProposer("suffix", NgramSettings(max_ngram=4, min_ngram=1, length_factor=1.0, min_share=0.0))
    context = [1, 2, 3, 4, 5, 6, 7, 8, 0, 3]  # matched length 1 -> depth 1
    assert paths(proposer.propose(proposer.new_index(context), context, budget=8).tree) == {(4,)}
    context = [1, 2, 3, 4, 5, 6, 7, 8, 0, 2, 3]  # matched length 2 -> depth 2
    assert paths(proposer.propose(proposer.new_index(context), context, budget=8).tree) == {(4,), (4, 5)}


def test_suffix_drafts_from_other_requests_outputs_and_forgets_the_oldest():
    proposer = NgramProposer("suffix", NgramSettings(min_ngram=2, recent_output_tokens=8, min_share=0.0))
    context = [40, 41]
    assert len(proposer.propose(proposer.new_index(context), context, budget=4)) == 0
    proposer.finished([40, 41, 42, 43])
    assert paths(proposer.propose(proposer.new_index(context), context, budget=4).tree) >= {(42,), (42, 43)}
    proposer.finished([1, 2, 3, 4, 5])  # 9 tokens held > 8: the first output goes
    assert len(proposer.recent) == 5
    assert len(proposer.propose(proposer.new_index(context), context, budget=4)) == 0


def test_recent_outputs_keep_at_most_their_token_budget():
    recent = RecentOutputs(max_tokens=10, max_n=2)
    for start in range(0, 100, 7):
        recent.add(list(range(start, start + 7)))
    assert len(recent) <= 10 and len(recent.snapshot()) == 1


def test_own_choices_back_off_from_the_longest_history_and_stay_bounded():
    own = OwnChoices(max_entries=8)
    own.record([1, 2, 3], 7)  # after 1 2 3 the drafter chose 7
    own.record([9, 2, 3], 8)  # after 9 2 3 it chose 8: the shorter histories now say 8
    assert own.guess([1, 2, 3], 1) == [7] and own.guess([9, 2, 3], 1) == [8] and own.guess([5, 2, 3], 1) == [8]
    assert own.guess([4, 4, 3], 1) == [8] and own.guess([4, 4, 4], 1) == []
    own.record([2, 3, 7], 8)
    own.record([3, 7, 8], 3)
    assert own.guess([1, 2, 3], 3) == [7, 8, 3]  # guesses chain on their own output
    own.record([5, 5, 5], 1)  # past max_entries the older half goes
    assert own.guess([1, 2, 3], 1) == [] and own.guess([2, 3, 7], 1) == [8] and own.guess([5, 5, 5], 1) == [1]


def test_merge_keeps_the_first_tree_and_adds_the_paths_it_lacks():
    ngram = DraftTree([5, 6, 7], [ROOT, 0, 1])
    model = DraftTree([5, 9, 8], [ROOT, 0, ROOT])
    merged = merge_trees(ngram, model, budget=5)
    assert paths(merged) == {(5,), (5, 6), (5, 6, 7), (5, 9), (8,)}
    assert len(merge_trees(ngram, model, budget=4)) == 4


def test_ngram_settings_are_validated_with_the_key_named(tiny_dirs):
    with pytest.raises(ConfigError, match="drafter.ngram: method must be '' or one of"):
        config_from_dict({"drafter": {"ngram": {"method": "bigram"}}})
    with pytest.raises(ConfigError, match="drafter.ngram: min_ngram"):
        config_from_dict({"drafter": {"ngram": {"min_ngram": 5, "max_ngram": 3}}})
    with pytest.raises(ConfigError, match="drafter.ngram.method is for a model drafter"):
        config_from_dict({"drafter": {"model": "suffix", "ngram": {"method": "suffix"}}})
    with pytest.raises(ConfigError, match="drafter_in_process needs a drafter without a model"):
        config_from_dict({"coordinator": {"drafter_in_process": True}})


def ngram_config(tiny_dirs, drafter: str, verifier: str = "verifier", **ngram) -> dict:
    config = tiny_config(tiny_dirs, num_draft_tokens=4)
    config["verifier"]["model"] = str(tiny_dirs[verifier])
    if drafter in ("prompt-lookup", "suffix"):
        config["drafter"] = {"model": drafter, "ngram": {"min_ngram": 1, **ngram}}
    else:
        config["drafter"]["ngram"] = {"method": drafter.split("+")[1], "min_ngram": 1, **ngram}
    return config


@pytest.mark.parametrize("drafter", ["prompt-lookup", "suffix", "model+suffix"])
def test_greedy_through_ngram_drafters_equals_generate(tiny_dirs, tiny_verifier, drafter):
    prompts = [[1, 5, 9, 4, 1, 5], [3, 3, 7], [11, 4, 8, 12, 6, 11, 4, 8]]
    with local_stack(ngram_config(tiny_dirs, drafter)) as stack:
        client = CoordinatorClient(stack["coordinator"])
        accepted = 0
        for ids in prompts * 2:  # the second pass also drafts from the first pass's outputs (suffix)
            response = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=40))
            assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40), ids
            accepted += response.stats.accepted_draft_tokens
        client.close()
    assert accepted > 0  # random tiny models repeat themselves: n-grams find it


def test_a_model_free_drafter_pairs_with_any_tokenizer(tiny_dirs):
    """The n-gram drafter has no tokenizer, so a verifier with other words is fine."""
    from specdec.core.models import ModelSpec, load_model

    verifier = load_model(ModelSpec(str(tiny_dirs["other_words"])))
    with local_stack(ngram_config(tiny_dirs, "prompt-lookup", verifier="other_words")) as stack:
        client = CoordinatorClient(stack["coordinator"])
        ids = [4, 5, 6, 4, 5]
        response = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=30))
        client.close()
    assert list(response.token_ids) == hf_greedy(verifier, ids, 30)


@pytest.mark.parametrize("drafter", [pytest.param("prompt-lookup", marks=pytest.mark.slow), "model+prompt-lookup"])  # CI: the hybrid
def test_sampling_with_ngram_drafts_follows_the_verifier_distribution(tiny_dirs, tiny_verifier, drafter):
    """Power: a TVD of 0.021 (mass moved between the two likeliest cells) is caught half the
    time over its 2,000 draws (tests/stats.py detectable_tvd)."""
    # (1, 5) repeats, so every request's first round drafts 9 as a point-mass proposal.
    with local_stack(ngram_config(tiny_dirs, drafter)) as stack:
        client = CoordinatorClient(stack["coordinator"])
        stats = client.generate(generate_request(prompt_token_ids=[1, 5, 9, 1, 5], max_new_tokens=2, temperature=0.9)).stats
        client.close()
        assert stats.drafted_tokens == 1
        sampled_first_two_tokens(stack, tiny_verifier, draws=2000, prompt=(1, 5, 9, 1, 5))


def test_a_model_free_drafter_runs_inside_the_coordinator(tiny_dirs, tiny_verifier):
    config = {
        **ngram_config(tiny_dirs, "suffix"),
        "coordinator": {"drafter_in_process": True, "num_draft_tokens": 4, "adaptive": {"enabled": False}},
    }
    with local_stack(config) as stack:
        assert "drafter" not in stack  # no drafter server
        client = CoordinatorClient(stack["coordinator"])
        ids = [11, 4, 8, 12, 6, 11, 4, 8]
        response = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=40))
        client.close()
    assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40)
    # It drafted, and from this process: no gRPC link to a drafter service.
    assert response.stats.drafted_tokens > 0 and response.stats.drafter_replica.startswith("in-process:"), response.stats.drafter_replica


def test_fallback_hybrid_drafts_the_ngram_alone_where_the_context_matches(tiny_dirs):
    """drafter.ngram.fallback: a matching context gets the n-gram draft alone, with no drafter
    forward; an unmatched one the model's draft (the merged hybrid runs the model on both)."""
    from drafter_service.selection import drafter_for
    from specdec.core.models import ModelSpec
    from specdec.core.sampling import Sampling
    from specdec.core.tree import TreeShape

    spec = ModelSpec(str(tiny_dirs["drafter"]))
    matched, unmatched = [1, 5, 9, 4, 7, 2, 5, 9, 4], [1, 5, 9, 4, 7, 2, 3, 11]
    forwards = {}
    for fallback in (True, False):
        engine = drafter_for(spec, ngram=NgramSettings(method="suffix", fallback=fallback, recent_output_tokens=0))
        for name, context in (("matched", matched), ("unmatched", unmatched)):
            session = engine.open_session(name, context, Sampling(), "")
            draft = engine.draft(session_id=name, session=session, new_tokens=[], committed_length=len(context), num_tokens=4,
                                 shape=TreeShape(method="chain"))
            assert len(draft.tree)
            forwards[fallback, name] = draft.forward_passes
            if fallback and name == "matched":
                assert draft.tree.token_ids[:2] == [7, 2]  # what followed "5 9 4" before
    assert forwards[True, "matched"] == 0 < forwards[False, "matched"]
    assert forwards[True, "unmatched"] > 0


@pytest.mark.parametrize("method", ["chain", "dynamic"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_staged_drafting_drafts_the_same_trees_with_fewer_forwards(tiny_dirs, method, temperature):
    """Staged speculation: the second stage (the drafter's own earlier choices, else the
    context's n-grams) guesses the drafter's tokens; checked in the forwards the drafter runs
    anyway, right guesses save forwards and change nothing. With memory across requests a
    second session starts from what the first taught it; without, each starts afresh."""
    from drafter_service.selection import drafter_for
    from specdec.core.models import ModelSpec, load_model
    from specdec.core.sampling import Sampling
    from specdec.core.tree import TreeShape

    spec = ModelSpec(str(tiny_dirs["drafter"]))
    # The tiny drafter soon repeats itself: its own output is the context the n-grams learn from.
    context = [1, 5, 9] + hf_greedy(load_model(spec), [1, 5, 9], 24)
    plain = drafter_for(spec)
    staged = drafter_for(spec, ngram=NgramSettings(min_ngram=1), staged_lookahead=4)
    alone = drafter_for(spec, ngram=NgramSettings(min_ngram=1, recent_output_tokens=0), staged_lookahead=4)  # no memory across requests
    shape = TreeShape(method=method, width=2)
    trees, forwards = {}, {}
    for engine in (plain, staged, alone):
        for session_id in ("first", "second"):
            session = engine.open_session(session_id, context, Sampling(temperature=temperature, seed=7), "")
            trees[engine, session_id], forwards[engine, session_id], new = [], 0, []
            for _ in range(6):  # each round commits the draft's first two tokens
                draft = engine.draft(session_id=session_id, session=session, new_tokens=new,
                                     committed_length=len(session.tokens) + len(new), num_tokens=6, shape=shape)
                trees[engine, session_id].append((draft.tree.token_ids, draft.tree.parent))
                forwards[engine, session_id] += draft.forward_passes
                new = draft.tree.token_ids[:1] + draft.tree.token_ids[1:2] if draft.tree.parent[1:2] == [0] else draft.tree.token_ids[:1]
    for session_id in ("first", "second"):
        assert trees[staged, session_id] == trees[alone, session_id] == trees[plain, session_id]
        assert forwards[staged, session_id] < forwards[plain, session_id]
    assert forwards[staged, "second"] < forwards[staged, "first"] == forwards[alone, "first"] == forwards[alone, "second"]


def test_the_adaptive_controller_runs_hybrid_plans_exactly(tiny_dirs, tiny_verifier):
    config = tiny_config(tiny_dirs, adaptive={"chain_budgets": [2], "tree_budgets": [], "hybrid_budgets": [4]})
    ids = [11, 4, 8, 12, 6, 11, 4, 8]
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        response = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=40, adaptive=True))
        client.close()
    assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40)
    assert response.stats.plan_rounds["chain-4+suffix"] >= 1  # every plan is tried at least once
    assert set(response.stats.plan_rounds) <= {"fused", "chain-2", "chain-4+suffix"}


def test_each_request_chooses_its_ngram_candidates(tiny_dirs, tiny_verifier):
    """tree.ngram per request: a model drafter drafts alone, or merges prompt-lookup or
    suffix candidates into its drafts; a drafter without a model refuses `none`."""
    import grpc

    from specdec.core.tree import TreeShape
    from specdec.serving.wire import shape_to_proto

    ids = [11, 4, 8, 12, 6, 11, 4, 8]
    with local_stack(tiny_config(tiny_dirs, num_draft_tokens=4)) as stack:
        client = CoordinatorClient(stack["coordinator"])
        accepted = {}
        for ngram in ("none", "prompt-lookup", "suffix"):
            request = generate_request(prompt_token_ids=ids, max_new_tokens=40, tree=shape_to_proto(TreeShape(ngram=ngram)))
            response = client.generate(request)
            assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40), ngram
            accepted[ngram] = response.stats.accepted_draft_tokens
        client.close()
    assert max(accepted["prompt-lookup"], accepted["suffix"]) > accepted["none"]
    with local_stack(ngram_config(tiny_dirs, "suffix")) as stack:
        client = CoordinatorClient(stack["coordinator"])
        with pytest.raises(grpc.RpcError) as err:
            client.generate(generate_request(prompt_token_ids=ids, tree=shape_to_proto(TreeShape(ngram="none"))))
        client.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "has no model" in err.value.details()


def test_a_wrapped_drafter_forwards_every_hook():
    """HybridDrafter and CrossTokenizerDrafter wrap another drafter: every hook of the interface
    reaches the inner one unless they override it."""
    import inspect

    from drafter_service.drafting import Drafter, WrappedDrafter

    hooks = {name for name, member in vars(Drafter).items() if inspect.isfunction(member) and not name.startswith("_")}
    assert hooks <= set(vars(WrappedDrafter)), sorted(hooks - set(vars(WrappedDrafter)))
