"""The real stack: Ray Serve deploys drafter, verifier and coordinator with the default
SmolLM2 pair (the verifier in int8), and a plain gRPC client that knows only the protos gets
exactly what the served verifier alone decodes, one token per call."""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.core.hub import BUILTIN_SMOLLM2
from specdec.core.models import ModelSpec, hf_greedy, load_model, load_tokenizer
from specdec.core.prompts import PACKAGED_PROMPTS, chat_ids
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import free_port

# Not from Spec-Bench, and not seen anywhere else in the project.
UNSEEN_PROMPTS = [
    "Describe how a lighthouse keeper might spend a stormy night.",
    "List three ways to keep basil fresh after buying it.",
]


@pytest.fixture(scope="module")
def serve_ports() -> dict[str, int]:
    """Where Serve's proxies listen in this module: the OpenAI HTTP API and the gRPC proxy."""
    return {"http": free_port(), "grpc": free_port()}


@pytest.fixture(scope="module")
def ray_stack(serve_ports):
    from specdec.app.launch import start_stack, stop_stack

    port = free_port()
    address = start_stack({"coordinator": {"port": port}}, port, http_port=serve_ports["http"], grpc_proxy_port=serve_ports["grpc"])
    yield address
    stop_stack()


@pytest.mark.e2e
def test_health_service_reports_serving(ray_stack):
    with grpc.insecure_channel(ray_stack) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specdec.v1.Coordinator"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def verifier_alone(stub, ids: list[int], max_new_tokens: int) -> list[int]:
    """The served verifier decoding alone, one token per forward: the reference of exactness."""
    request = coordinator_pb2.GenerateRequest(prompt_token_ids=ids, max_new_tokens=max_new_tokens, num_draft_tokens=0)
    return list(stub.Generate(request, timeout=600).token_ids)


@pytest.mark.e2e
def test_plain_grpc_client_gets_the_verifiers_greedy_output(ray_stack):
    tokenizer = load_tokenizer(BUILTIN_SMOLLM2)
    with grpc.insecure_channel(ray_stack) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        # The server's default (the controller picks each round's plan), then a named plan.
        for prompt, budget in zip(UNSEEN_PROMPTS, (None, 4)):
            request = coordinator_pb2.GenerateRequest(prompt=prompt, use_chat_template=True, max_new_tokens=128, num_draft_tokens=budget)
            parts = list(stub.GenerateStream(request, timeout=600))
            tokens = [t for p in parts for t in p.token_ids]
            assert tokens == verifier_alone(stub, chat_ids(tokenizer, prompt), 128), prompt
            stats = parts[-1].stats
            assert stats.rounds > 0 and stats.bytes_sent > 0 and stats.verifier_state
            assert parts[-1].finish_reason in ("stop", "length")
            if budget is None:
                # The controller tries every plan once before it chooses, so a fresh stack's
                # first adaptive request speculates too; its rounds add up plan by plan.
                assert stats.policy == "adaptive" and sum(stats.plan_rounds.values()) == stats.rounds
                assert stats.speculative_rounds == stats.rounds - stats.plan_rounds.get("fused", 0) > 0
            else:
                # The default drafter reads the verifier's features, which cross both links every round.
                assert stats.policy == "fixed" and stats.speculation_budget == budget
                assert stats.verifier_state_bytes > 0 and stats.speculative_rounds > 0 and stats.accepted_draft_tokens > 0


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["dynamic", "rsd-s"])
def test_draft_trees_with_the_default_pair_match_the_verifier_alone(ray_stack, method):
    tokenizer = load_tokenizer(BUILTIN_SMOLLM2)
    ids = chat_ids(tokenizer, UNSEEN_PROMPTS[1])
    with grpc.insecure_channel(ray_stack) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.GenerateRequest(
            prompt_token_ids=ids, max_new_tokens=64, num_draft_tokens=16, tree=common_pb2.TreeShape(method=method)
        )
        reply = stub.Generate(request, timeout=600)
        assert list(reply.token_ids) == verifier_alone(stub, ids, 64)
    assert reply.stats.tree_method == method and reply.stats.speculative_rounds > 0 and reply.stats.accepted_draft_tokens > 0


@pytest.mark.e2e
def test_float32_default_verifier_equals_generate():
    """With float32 weights the served verifier is transformers' own model: its greedy tree
    verification equals `generate()` (checked in-process on the engine the service runs)."""
    from specdec.core.engine import engine_for

    tokenizer = load_tokenizer(BUILTIN_SMOLLM2)
    model = load_model(ModelSpec(BUILTIN_SMOLLM2))
    engine = engine_for(model, "float32")
    ids = chat_ids(tokenizer, UNSEEN_PROMPTS[0])
    reference = hf_greedy(model, ids, 24)
    with torch.inference_mode():
        cache = engine.new_cache()
        logits, _ = engine(cache, ids + reference[:-1], num_logits=len(reference))
    assert logits.argmax(dim=-1).tolist() == reference


@pytest.mark.e2e
def test_request_metrics_reach_prometheus(ray_stack):
    """The coordinator's metrics are on the node's Prometheus endpoint (Ray prefixes ray_)."""
    import ray

    with grpc.insecure_channel(ray_stack) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stub.Generate(coordinator_pb2.GenerateRequest(prompt="Hi", max_new_tokens=16, num_draft_tokens=4), timeout=600)
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline, text = time.time() + 90, ""
    wanted = ("ray_specdec_requests", "ray_spec_decode_num_drafts", "ray_specdec_replica_sessions")
    while time.time() < deadline and not all(name in text for name in wanted):
        time.sleep(3)
        with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    names = ("ray_specdec_requests", "ray_specdec_generated_tokens", "ray_specdec_round_time_ms", "ray_specdec_bytes")
    for name in names + ("ray_spec_decode_num_drafts", "ray_spec_decode_num_draft_tokens"):  # vLLM's names too
        assert name in text, name
    # Each model replica's load, for autoscaling on what Serve's own metrics cannot see.
    for name in ("ray_specdec_replica_sessions", "ray_specdec_replica_kv_cache_mib", "ray_specdec_replica_resident_mib"):
        assert name in text, name
    assert 'deployment="Verifier"' in text and 'deployment="Drafter"' in text


@pytest.mark.e2e
def test_openai_client_through_serves_http_proxy_gets_the_grpc_text(ray_stack, serve_ports):
    import openai

    api = openai.OpenAI(base_url=f"http://localhost:{serve_ports['http']}/v1", api_key="unused", max_retries=0, timeout=600)
    model = api.models.list().data[0].id
    prompt = UNSEEN_PROMPTS[0]
    with grpc.insecure_channel(ray_stack) as channel:
        expected = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
            coordinator_pb2.GenerateRequest(prompt=prompt, use_chat_template=True, max_new_tokens=40), timeout=600
        )
    messages = [{"role": "user", "content": prompt}]
    reply = api.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == expected.text
    chunks = list(api.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].model_extra["speculation"]["verifier_state"]  # the feature head drafted from the verifier's state


@pytest.mark.e2e
def test_structured_outputs_through_serves_http_proxy_parse_and_equal_the_constrained_verifier_alone(ray_stack, serve_ports):
    """The openai client's parse helper with a Pydantic model, through Serve's HTTP proxy and the
    default pair (the feature head drafting after the grammar's forced tokens): a valid object,
    the text the constrained verifier alone decodes."""
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)

    api = openai.OpenAI(base_url=f"http://localhost:{serve_ports['http']}/v1", api_key="unused", max_retries=0, timeout=600)
    prompt = "Name a city on a river, as JSON with its name and its country."
    reply = api.chat.completions.parse(
        model=api.models.list().data[0].id, messages=[{"role": "user", "content": prompt}], max_tokens=60, temperature=0,
        response_format=City,
    )
    assert isinstance(reply.choices[0].message.parsed, City) and reply.choices[0].finish_reason == "stop"
    request = coordinator_pb2.GenerateRequest(
        prompt=prompt, use_chat_template=True, max_new_tokens=60, num_draft_tokens=0,
        constraint=common_pb2.Constraint(json_schema=json.dumps(City.model_json_schema() | {"additionalProperties": False})),
    )
    with grpc.insecure_channel(ray_stack) as channel:
        alone = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=600)
    assert json.loads(alone.text) == json.loads(reply.choices[0].message.content)


@pytest.mark.e2e
def test_the_playground_page_marks_each_token_as_the_request_stats_count_it(ray_stack, serve_ports, tmp_path):
    """The page at / in headless Chromium against the real stack: it streams the gRPC API's
    greedy text, and the tokens it marks drafted are the accepted drafts of its request's stats."""
    from selenium.webdriver.common.by import By

    from tests.browser import ask_playground, chromium

    prompt = UNSEEN_PROMPTS[1]
    with grpc.insecure_channel(ray_stack) as channel:
        expected = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
            coordinator_pb2.GenerateRequest(prompt=prompt, use_chat_template=True, max_new_tokens=48), timeout=600
        )
    browser = chromium()
    try:
        ask_playground(browser, f"http://localhost:{serve_ports['http']}/", prompt, "chain-4", 48, timeout_s=600)
        browser.save_screenshot(str(tmp_path / "playground.png"))
        assert browser.find_element(By.ID, "error").text == ""
        answer = browser.execute_script("return document.getElementById('answer').textContent")
        assert answer == expected.text
        marks = browser.execute_script(
            "return Array.from(document.querySelectorAll('#answer span')).map(s => [s.className.split(' ')[0], +s.dataset.tokens])"
        )
        accepted = browser.find_element(By.ID, "stat-accepted")
        assert sum(tokens for kind, tokens in marks if kind == "draft") == int(accepted.get_attribute("data-stats")) > 0
        assert int(accepted.text) == int(accepted.get_attribute("data-stats"))
        assert sum(tokens for _, tokens in marks) == len(expected.token_ids) == int(browser.find_element(By.ID, "stat-tokens").text)
        assert browser.find_element(By.ID, "stat-finish").text == expected.finish_reason
        assert "chain-4" in browser.find_element(By.ID, "plans").text
    finally:
        browser.quit()


@pytest.mark.e2e
def test_serves_grpc_proxy_routes_the_coordinator_api(ray_stack, serve_ports):
    """Clients may come in through Serve's own gRPC proxy (metadata `application` names the app)."""
    from specdec.app.launch import APP_NAME

    request = coordinator_pb2.GenerateRequest(prompt="Name a colour.", use_chat_template=True, max_new_tokens=24)
    with grpc.insecure_channel(ray_stack) as direct, grpc.insecure_channel(f"localhost:{serve_ports['grpc']}") as proxied:
        expected = coordinator_pb2_grpc.CoordinatorStub(direct).Generate(request, timeout=600)
        stub = coordinator_pb2_grpc.CoordinatorStub(proxied)
        metadata = (("application", APP_NAME),)
        assert stub.Generate(request, timeout=600, metadata=metadata).text == expected.text
        parts = list(stub.GenerateStream(request, timeout=600, metadata=metadata))
        assert "".join(p.text for p in parts) == expected.text and parts[-1].finish_reason == expected.finish_reason
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(coordinator_pb2.GenerateRequest(prompt="Hi", temperature=-1), timeout=60, metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in refused.value.details()


@pytest.mark.e2e
def test_a_short_soak_counts_every_request_and_leaves_no_session(ray_stack, tmp_path):
    """scripts/soak.py against the stack for a few seconds (greedy, sampled, cancelled and bad
    requests mixed): every greedy output exact, nothing unexpected, no session left, its report
    written and its verdict true."""
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).resolve().parents[1] / "scripts" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    out = tmp_path / "soak.json"
    args = argparse.Namespace(
        minutes=0.1, concurrency=3, max_new_tokens=8, num_prompts=2, prompts=str(PACKAGED_PROMPTS), config=None,
        out=str(out), address=None, cluster=False,
    )
    assert soak.run_soak(args, ray_stack)
    report = json.loads(out.read_text())
    assert report["unexpected_count"] == 0 and report["sessions_left"] == 0
    assert report["requests"] == sum(report["outcomes"].values()) > 0
    assert {"verifier", "drafter"} == set(report["services_end"]) and report["services_end"]["verifier"]["resident_mib"] > 0
