"""Overlapped drafting (PEARL): the drafter drafts the next round while the verifier checks
this one. The output stays exactly the verifier's, greedy and sampled, and a drafter that
guesses right gets its next round for free."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.core.models import hf_greedy
from specdec.core.tree import TREE_METHODS
from specdec.serving.client import CoordinatorClient, generate_request
from tests.conftest import local_stack, tiny_config
from tests.stats import assert_matches_distribution
from tests.test_trees import SERVICE_PROMPTS, tree_request


@pytest.fixture(scope="module")
def overlap_stack(tiny_dirs):
    with local_stack(tiny_config(tiny_dirs, overlap=True)) as stack:
        stack["client"] = CoordinatorClient(stack["coordinator"])
        yield stack
        stack["client"].close()


@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_with_overlap_is_token_identical_to_generate(overlap_stack, tiny_verifier, method):
    for ids in SERVICE_PROMPTS:
        response = overlap_stack["client"].generate(
            generate_request(prompt_token_ids=ids, max_new_tokens=40, num_draft_tokens=6, tree=tree_request(method))
        )
        assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40), (method, ids)
        assert response.stats.overlap


def test_adaptive_with_overlap_is_token_identical_to_generate(overlap_stack, tiny_verifier):
    for ids in SERVICE_PROMPTS:
        response = overlap_stack["client"].generate(generate_request(prompt_token_ids=ids, max_new_tokens=40, adaptive=True))
        assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40)
        assert response.stats.policy == "adaptive"


def test_a_drafter_that_guesses_right_skips_its_wait(tiny_dirs, tiny_verifier):
    config = tiny_config(tiny_dirs, overlap=True, tree={"method": "chain"})
    config["drafter"]["model"] = str(tiny_dirs["verifier"])  # every draft accepted, every guess right
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        response = client.generate(generate_request(prompt_token_ids=SERVICE_PROMPTS[0], max_new_tokens=40, num_draft_tokens=3))
        client.close()
    assert list(response.token_ids) == hf_greedy(tiny_verifier, SERVICE_PROMPTS[0], 40)
    speculative = response.stats.rounds - response.stats.plan_rounds.get("fused", 0)
    assert response.stats.overlap_hits >= speculative - 2


@pytest.mark.slow  # 160 s; overlapped rounds verify as plain ones do (greedy exactness with overlap runs in CI)
def test_sampling_with_overlap_follows_the_verifier_distribution(tiny_dirs, tiny_verifier):
    """With one draft per round, a round whose overlapped guess came true commits two tokens
    and the third comes from the round drafted ahead: its marginal must be the verifier's.
    The drafter is the verifier's weights perturbed: its guesses come true often, and its
    drafts differ from the verifier's distribution (a sampler that always accepts fails).
    Power: a TVD of 0.028 (mass moved between the two likeliest cells) is caught half the time
    over its 2,500 draws (tests/stats.py detectable_tvd)."""
    temperature, prompt, eos = 0.9, [1, 5, 9], 2
    with torch.inference_mode():
        def probs(prefixes):
            return torch.softmax(tiny_verifier(torch.tensor(prefixes)).logits[:, -1] / temperature, -1).double()

        vocab = tiny_verifier.config.vocab_size
        first = probs([prompt])[0]
        second = probs([prompt + [a] for a in range(vocab)])
        third = probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).reshape(vocab, vocab, vocab)
    weight = first[:, None] * second
    weight[eos, :] = 0
    weight[:, eos] = 0  # sequences that ended before a third token are not observed
    exact = (weight[:, :, None] * third).sum((0, 1))
    counts = torch.zeros(vocab)
    config = tiny_config(tiny_dirs, overlap=True)
    config["drafter"]["model"] = str(tiny_dirs["near_verifier"])
    requests = [
        generate_request(prompt_token_ids=prompt, max_new_tokens=4, temperature=temperature, seed=seed, num_draft_tokens=1)
        for seed in range(2500)
    ]
    hits = 0
    with local_stack(config) as stack, ThreadPoolExecutor(max_workers=4) as pool:
        client = CoordinatorClient(stack["coordinator"])
        for answer in pool.map(client.generate, requests):
            hits += answer.stats.overlap_hits
            if len(answer.token_ids) >= 3:
                counts[answer.token_ids[2]] += 1
        client.close()
    assert hits > 200  # the draft made ahead was used often enough to matter
    assert_matches_distribution(counts, exact)


def test_a_guess_that_nothing_is_accepted_gets_the_drafters_other_pick(overlap_stack):
    """The likeliest guess of a weak drafter: the verifier keeps none of the draft. The drafter
    then drafts after its likeliest token other than the rejected ones (until session 23 it
    ignored the exclusions when no token was assumed, and such guesses could never come true)."""
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import DRAFTER_SERVICE
    from specdec.v1 import common_pb2, drafter_pb2

    drafter = MeasuredClient(overlap_stack["drafter"], DRAFTER_SERVICE)
    chain = common_pb2.TreeShape(method="chain")

    def draft(session_id: str, context: list[int], **fields) -> drafter_pb2.DraftResponse:
        start = common_pb2.SessionStart(context_token_ids=context, sampling=common_pb2.SamplingParams())
        request = drafter_pb2.DraftRequest(
            session_id=session_id, start=start, committed_length=len(context), num_draft_tokens=3, tree_shape=chain, **fields
        )
        return drafter.call("Draft", request, drafter_pb2.DraftResponse)[0]

    context = [1, 4, 5]
    first = draft("plain", context).tree.token_ids[0]
    guessed = draft("guess", context, pick_excludes=[first])
    (pick,) = guessed.assumed_token_ids
    assert pick != first
    assert list(guessed.tree.token_ids) == list(draft("after-pick", context + [pick]).tree.token_ids)
    drafter.close()


def test_the_overlap_guess_follows_the_likeliest_outcome_rejections_included():
    from collections import Counter

    from coordinator.decoding import overlap_guess
    from specdec.core.tree import DraftTree

    # Root children 5 (first choice) and 6; 5 -> 7 (and 8); 7 -> 9.
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2])
    assert overlap_guess(tree, Counter()) == ([5, 7, 9], [])  # nothing measured yet: all accepted
    assert overlap_guess(tree, Counter({3: 2, 1: 1})) == ([5, 7, 9], [])
    # Mostly one token accepted: assume it, and the correction is neither 7 nor 8.
    assert overlap_guess(tree, Counter({1: 3, 3: 1})) == ([5], [7, 8])
    # Mostly nothing accepted: the correction at the root is neither 5 nor 6.
    assert overlap_guess(tree, Counter({0: 4, 2: 1})) == ([], [5, 6])
    # Deeper rounds earlier (accepted beyond this path) count as this path fully accepted.
    assert overlap_guess(DraftTree([5], [-1]), Counter({4: 2, 0: 1})) == ([5], [])
