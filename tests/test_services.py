"""The three services over real gRPC with tiny random-weight models: exactness against the
verifier's own generate(), streaming, stop strings, sessions and concurrency."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specdec.core.models import hf_greedy
from specdec.core.prompts import chat_ids
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.rpc import MeasuredClient
from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE
from specdec.v1 import common_pb2, verifier_pb2
from tests.conftest import local_stack, service_info, tiny_config
from tests.stats import assert_matches_distribution

PROMPTS = ["w1 w2 w3", "w7", "w4 w4 w9 w12 w0", "w11 w3 w8 w8 w2 w5 w6"]


@pytest.fixture(scope="module")
def client(tiny_stack):
    c = CoordinatorClient(tiny_stack["coordinator"])
    yield c
    c.close()


@pytest.mark.parametrize("budget", [0, 1, 3, 6])
def test_greedy_is_token_identical_to_generate(client, tiny_stack, tiny_verifier, budget):
    tokenizer = tiny_stack["coordinator_obj"].tokenizer
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        response = client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=40, num_draft_tokens=budget))
        assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 40), prompt
        assert response.finish_reason in ("stop", "length")
        assert response.stats.speculation_budget == budget


def test_text_prompt_chat_template_and_stats(client, tiny_stack, tiny_verifier):
    tokenizer = tiny_stack["coordinator_obj"].tokenizer
    response = client.generate(generate_request("w5 w6", use_chat_template=True, max_new_tokens=30))
    ids = chat_ids(tokenizer, "w5 w6")
    assert list(response.token_ids) == hf_greedy(tiny_verifier, ids, 30)
    assert response.text == tokenizer.decode(response.token_ids, skip_special_tokens=True)
    stats = response.stats
    assert stats.rounds >= 1 and stats.generated_tokens == len(response.token_ids)
    assert stats.draft_compute_ms > 0 and stats.verify_compute_ms > 0 and stats.wire_serialization_ms > 0
    assert stats.bytes_sent > 0 and stats.bytes_received > 0
    assert 0 <= stats.mean_accepted_per_round <= 3
    assert stats.accepted_draft_tokens <= stats.drafted_tokens


def test_the_controller_picks_the_plan_unless_the_request_names_one(tiny_dirs):
    """Adaptive is the served default (the verifier alone wherever speculation does not pay); a
    request that names its budget or tree runs that plan, and one that says adaptive gets it anyway."""
    from specdec.serving.config import Config

    assert Config().coordinator.adaptive.enabled
    config = tiny_config(tiny_dirs, adaptive={"enabled": True})
    named = (
        {}, {"num_draft_tokens": 2}, {"tree": common_pb2.TreeShape(method="chain")}, {"num_draft_tokens": 0},
        {"num_draft_tokens": 2, "adaptive": True}, {"adaptive": False},
    )
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        policies = [
            client.generate(generate_request(prompt_token_ids=[3, 4, 5], max_new_tokens=8, **fields)).stats.policy for fields in named
        ]
        client.close()
    assert policies == ["adaptive", "fixed", "fixed", "fixed", "adaptive", "fixed"]


def test_stream_concatenates_to_the_unary_answer(client):
    request = generate_request("w3 w9", max_new_tokens=30, num_draft_tokens=2)
    parts = list(client.stream(request))
    whole = client.generate(request)
    assert len(parts) >= 2
    assert "".join(p.text for p in parts) == whole.text
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert all(not p.finish_reason for p in parts[:-1]) and parts[-1].finish_reason == whole.finish_reason
    assert parts[-1].stats.rounds == whole.stats.rounds


def test_the_first_token_streams_alone_then_the_verifier_generates_in_blocks(client, tiny_stack):
    """The verifier alone streams its first token as soon as the prompt is read, then a block of
    coordinator.fused_block_tokens a message."""
    block = tiny_stack["coordinator_obj"].config.fused_block_tokens
    parts = list(client.stream(generate_request(prompt_token_ids=[3, 4, 5], max_new_tokens=1 + 2 * block, num_draft_tokens=0)))
    sizes = [len(p.token_ids) for p in parts if p.token_ids]
    assert sizes[0] == 1 and sizes[1] == block, sizes
    stats = parts[-1].stats
    assert 0 < stats.first_token_ms < stats.total_ms


def test_stop_string_ends_generation(client):
    full = client.generate(generate_request("w1 w2 w3", max_new_tokens=40))
    words = full.text.split()
    assert len(words) > 4
    stop = words[3]
    cut = client.generate(generate_request("w1 w2 w3", max_new_tokens=40, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    streamed = "".join(p.text for p in client.stream(generate_request("w1 w2 w3", max_new_tokens=40, stop=[stop])))
    assert streamed == cut.text


def test_max_new_tokens(client):
    response = client.generate(generate_request("w1 w2 w3", max_new_tokens=5))
    assert len(response.token_ids) <= 5
    assert response.finish_reason == ("stop" if 2 in response.token_ids else "length")


def test_concurrent_requests_do_not_cross_talk(client, tiny_stack, tiny_verifier):
    tokenizer = tiny_stack["coordinator_obj"].tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS] * 2
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda ids: client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=30)), prompts))
    for ids, answer in zip(prompts, answers):
        assert list(answer.token_ids) == hf_greedy(tiny_verifier, ids, 30)


def sampled_first_two_tokens(
    stack, tiny_verifier, draws: int, temperature: float = 0.9, prompt=(1, 5, 9), max_new_tokens: int = 2, **request
) -> None:
    """Many samples through the real services, checked against the verifier's exact joint
    distribution of the first two tokens (chi-square). `request` adds GenerateRequest fields."""
    prompt = list(prompt)
    with torch.inference_mode():
        first = torch.softmax(tiny_verifier(torch.tensor([prompt])).logits[0, -1] / temperature, -1).double()
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.softmax(tiny_verifier(batch).logits[:, -1] / temperature, -1).double()
    exact = first[:, None] * second
    counts = torch.zeros(vocab, vocab)
    client = CoordinatorClient(stack["coordinator"])
    requests = [
        generate_request(prompt_token_ids=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, **request)
        for seed in range(draws)
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for answer in pool.map(client.generate, requests):
            tokens = list(answer.token_ids)
            if tokens[0] == 2:  # EOS first: the second token is never generated
                continue
            counts[tokens[0], tokens[1]] += 1
    client.close()
    exact[2] = 0  # rows after EOS are not observed
    assert_matches_distribution(counts, exact)


def test_sampling_follows_the_verifier_distribution(tiny_dirs, tiny_verifier):
    """The joint distribution of the first two tokens through the services (T = 0.9, 2-node
    drafts). Power: a TVD of 0.037 (mass moved between the two likeliest cells) is caught half
    the time over its 2,500 draws (tests/stats.py detectable_tvd)."""
    with local_stack(tiny_config(tiny_dirs, num_draft_tokens=2)) as stack:
        sampled_first_two_tokens(stack, tiny_verifier, draws=2500)


def test_lost_session_is_reopened_with_full_context(tiny_dirs, tiny_verifier):
    """Services that forget sessions (max_sessions=1 under concurrent load) answer NOT_FOUND;
    the coordinator re-sends the context and the output stays exact."""
    config = tiny_config(tiny_dirs)
    config["limits"] = {"max_sessions": 1}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        prompts = [[3 + i, 4 + i, 5] for i in range(6)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            answers = list(pool.map(lambda ids: client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=30)), prompts))
        client.close()
        evicted = {
            service: service_info(stack[role], service).evicted_sessions
            for role, service in (("drafter", DRAFTER_SERVICE), ("verifier", VERIFIER_SERVICE))
        }
    for ids, answer in zip(prompts, answers):
        assert list(answer.token_ids) == hf_greedy(tiny_verifier, ids, 30)
    # Without them the exactness above would say nothing about re-opening.
    assert all(count >= 1 for count in evicted.values()), evicted
    assert sum(answer.stats.session_reopens for answer in answers) >= 1


def test_retried_round_commits_once(tiny_stack):
    verifier = MeasuredClient(tiny_stack["verifier"], VERIFIER_SERVICE)
    start = common_pb2.SessionStart(context_token_ids=[1, 4, 5], sampling=common_pb2.SamplingParams())
    tree = common_pb2.DraftTree(token_ids=[6, 7], parent=[-1, 0])
    first, _ = verifier.call(
        "Verify", verifier_pb2.VerifyRequest(session_id="retry", round=1, start=start, tree=tree), verifier_pb2.VerifyResponse
    )
    again, _ = verifier.call("Verify", verifier_pb2.VerifyRequest(session_id="retry", round=1, tree=tree), verifier_pb2.VerifyResponse)
    assert list(again.token_ids) == list(first.token_ids)
    assert again.committed_length == first.committed_length == 3 + len(first.token_ids)
    second, _ = verifier.call("Verify", verifier_pb2.VerifyRequest(session_id="retry", round=2), verifier_pb2.VerifyResponse)
    assert second.committed_length == first.committed_length + 1
    with pytest.raises(grpc.RpcError) as err:
        verifier.call("Verify", verifier_pb2.VerifyRequest(session_id="retry", round=5), verifier_pb2.VerifyResponse)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "round 5" in err.value.details()
    verifier.close()


def test_every_service_answers_server_reflection(tiny_stack):
    """grpcurl and other tools discover each API without the protos."""
    import grpc
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    for role, service, method in (
        ("coordinator", "specdec.v1.Coordinator", "GenerateStream"),
        ("drafter", "specdec.v1.Drafter", "Draft"),
        ("verifier", "specdec.v1.Verifier", "Verify"),
    ):
        with grpc.insecure_channel(tiny_stack[role]) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            assert {service, "grpc.health.v1.Health"} <= set(database.get_services())
            found = DescriptorPool(database).FindServiceByName(service)
            assert method in found.methods_by_name


def test_acceptance_by_position_adds_up(tiny_stack):
    """The counts behind vLLM's acceptance metrics: rounds, drafted, accepted and per position."""
    client = CoordinatorClient(tiny_stack["coordinator"])
    stats = client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=40, num_draft_tokens=3)).stats
    client.close()
    per_position = list(stats.accepted_per_position)
    assert stats.speculative_rounds > 0 and sum(per_position) == stats.accepted_draft_tokens > 0
    assert per_position == sorted(per_position, reverse=True) and len(per_position) <= 3
    assert per_position[0] <= stats.speculative_rounds
