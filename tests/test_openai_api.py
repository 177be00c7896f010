"""The OpenAI-compatible HTTP API, driven by the real `openai` client, over the tiny stack's
coordinator (the ASGI app in process; through Ray Serve's HTTP proxy in test_e2e.py): the
same text as the gRPC API, streamed and not, and clear OpenAI-style errors."""
from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from coordinator.openai_api import OpenAIFrontend, openai_app
from coordinator.server import CoordinatorServicer
from specdec.core.models import hf_greedy
from specdec.core.prompts import chat_ids
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.v1 import common_pb2

MODEL = "tiny-verifier"


def _app(stack, tokens=frozenset()):
    return openai_app(OpenAIFrontend(CoordinatorServicer(stack["coordinator_obj"]), MODEL, set(tokens)))


@pytest.fixture(scope="module")
def http(tiny_stack):
    with TestClient(_app(tiny_stack)) as client:
        yield client


@pytest.fixture(scope="module")
def api(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(tiny_stack):
    client = CoordinatorClient(tiny_stack["coordinator"])
    yield client
    client.close()


def test_completion_equals_the_grpc_answer_and_the_verifier(api, grpc_client, tiny_stack, tiny_verifier):
    tokenizer = tiny_stack["coordinator_obj"].tokenizer
    reply = api.completions.create(model=MODEL, prompt="w4 w4 w9", max_tokens=24, temperature=0)
    expected = grpc_client.generate(generate_request("w4 w4 w9", max_new_tokens=24))
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    ids = tokenizer("w4 w4 w9")["input_ids"]
    assert list(expected.token_ids) == hf_greedy(tiny_verifier, ids, 24)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    assert reply.object == "text_completion" and reply.model == MODEL


def test_streamed_chat_with_usage_equals_the_grpc_chat_answer(api, grpc_client):
    chunks = list(api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=30, temperature=0,
        stream=True, stream_options={"include_usage": True},
    ))
    expected = grpc_client.generate(generate_request("w5 w6", use_chat_template=True, max_new_tokens=30))
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content) >= 3 and "".join(content) == expected.text
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_rounds_mark_the_text_as_the_stats_count_it(api, grpc_client):
    """stream_options.include_rounds: each chunk's spans cover its text, the drafted spans'
    tokens are the accepted drafts the stats count, and the rounds add up to the request's."""
    chunks = list(api.completions.create(
        model=MODEL, prompt="w3 w4 w3 w4 w3", max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_rounds": True},
        extra_body={"speculation": {"num_draft_tokens": 4, "tree": {"method": "chain"}}},
    ))
    stats = chunks[-1].model_extra["speculation"]
    texts = [c.choices[0] for c in chunks if c.choices]
    spans = [span for choice in texts for span in choice.model_extra["spans"]]
    rounds = [info for c in chunks for info in c.model_extra.get("rounds", [])]
    assert all(sum(span["chars"] for span in choice.model_extra["spans"]) == len(choice.text) for choice in texts)
    assert sum(span["tokens"] for span in spans if span["drafted"]) == stats["accepted_draft_tokens"] > 0
    assert sum(span["tokens"] for span in spans) == chunks[-1].usage.completion_tokens
    assert len(rounds) == stats["rounds"] and {r["plan"] for r in rounds} <= {"chain-4", "fused"}
    assert sum(r["accepted_draft_tokens"] for r in rounds) == stats["accepted_draft_tokens"]
    assert sum(r["drafted_tokens"] for r in rounds) == stats["drafted_tokens"]
    assert all(r["round_ms"] >= r["verify_ms"] > 0 for r in rounds)
    whole = grpc_client.generate(
        generate_request("w3 w4 w3 w4 w3", max_new_tokens=40, num_draft_tokens=4, tree=common_pb2.TreeShape(method="chain"))
    )
    assert [(s.chars, s.tokens, s.drafted) for s in whole.spans] == [(s["chars"], s["tokens"], s["drafted"]) for s in spans]


def test_chat_turns_use_the_template_and_the_extension_field(api, tiny_stack, tiny_verifier):
    turns = [{"role": "system", "content": "w1"}, {"role": "user", "content": [{"type": "text", "text": "w2 w3"}]}]
    reply = api.chat.completions.create(
        model=MODEL, messages=turns, max_tokens=20, temperature=0,
        extra_body={"speculation": {"num_draft_tokens": 4, "tree": {"method": "dynamic", "width": 2}}},
    )
    tokenizer = tiny_stack["coordinator_obj"].tokenizer
    expected = hf_greedy(
        tiny_verifier, chat_ids(tokenizer, [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"}]), 20
    )
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    spec = reply.model_extra["speculation"]
    assert spec["tree_method"] == "dynamic" and spec["speculation_budget"] == 4
    assert spec["mean_acceptance_length"] >= 1 and 0 <= spec["acceptance_rate"] <= 1
    alone = api.completions.create(
        model=MODEL, prompt="w7", max_tokens=10, temperature=0, extra_body={"speculation": {"num_draft_tokens": 0}}
    )
    assert set(alone.model_extra["speculation"]["plan_rounds"]) == {"fused"}


def test_stop_seed_and_sampling_parameters_reach_the_coordinator(api, grpc_client):
    fields = dict(max_new_tokens=30, temperature=0.9, top_p=0.8, seed=7)
    expected = grpc_client.generate(generate_request("w2 w8", stop=["w3"], **fields))
    for _ in range(2):  # a seed makes a sampled answer repeatable
        reply = api.completions.create(model=MODEL, prompt="w2 w8", max_tokens=30, temperature=0.9, top_p=0.8, seed=7, stop="w3")
        assert reply.choices[0].text == expected.text
    streamed = api.completions.create(
        model=MODEL, prompt="w2 w8", max_tokens=30, temperature=0.9, top_p=0.8, seed=7, stop=["w3"], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text


@pytest.mark.parametrize(
    "call, status, words",
    [
        (dict(temperature=-1), 400, "temperature"),
        (dict(model="gpt-4"), 404, "gpt-4"),
        (dict(n=2), 400, "n:"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(extra_body={"speculation": {"width": 3}}), 400, "unknown field width"),
        (dict(extra_body={"speculation": {"num_draft_tokens": 10**6}}), 400, "num_draft_tokens"),
        (dict(extra_body={"speculation": {"tree": {"method": "forest"}}}), 400, "forest"),
        (dict(prompt=""), 400, "empty"),
        (dict(stream=True, temperature="hot"), 400, "temperature"),
        (dict(stream=True, top_p=1.5), 400, "top_p"),
    ],
)
def test_bad_requests_get_openai_errors(api, call, status, words):
    fields = {"model": MODEL, "prompt": "w1", "max_tokens": 4} | call
    with pytest.raises(openai.APIStatusError) as caught:
        reply = api.completions.create(**fields)
        list(reply) if fields.get("stream") else None
    assert caught.value.status_code == status
    assert words in caught.value.body["message"]


def test_malformed_bodies_and_roles_are_refused(http):
    assert http.post("/v1/completions", content=b"{not json").status_code == 400
    assert http.post("/v1/completions", json=[1, 2]).status_code == 400
    nan = http.post("/v1/completions", content=b'{"model": "%s", "prompt": "w1", "temperature": NaN}' % MODEL.encode())
    assert nan.status_code == 400 and "temperature" in nan.json()["error"]["message"]
    bad_role = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]})
    assert bad_role.status_code == 400 and "role" in bad_role.json()["error"]["message"]
    assert http.get("/health").json() == {"status": "ok"}


def test_bearer_tokens_guard_the_http_api(tiny_stack):
    with TestClient(_app(tiny_stack, {"secret"})) as http:
        for key, ok in (("wrong", False), ("secret", True)):
            api = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
            if ok:
                assert api.models.list().data[0].id == MODEL
                assert api.completions.create(model=MODEL, prompt="w1", max_tokens=3, temperature=0).choices[0].text
            else:
                with pytest.raises(openai.AuthenticationError):
                    api.models.list()
                with pytest.raises(openai.AuthenticationError):
                    api.completions.create(model=MODEL, prompt="w1", max_tokens=3)
        assert http.get("/health").status_code == 200  # probes need no token


def test_busy_coordinator_answers_429(api, tiny_stack):
    slots = tiny_stack["coordinator_obj"].slots
    taken = 0
    while slots.acquire(blocking=False):
        taken += 1
    try:
        with pytest.raises(openai.RateLimitError):
            api.completions.create(model=MODEL, prompt="w1", max_tokens=3)
    finally:
        for _ in range(taken):
            slots.release()
    assert api.completions.create(model=MODEL, prompt="w1", max_tokens=3, temperature=0).choices[0].text


def test_real_http_client_needs_no_sdk(http):
    """A plain HTTP client sees the SSE framing: data lines, then [DONE]."""
    with http.stream(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 6, "temperature": 0, "stream": True}
    ) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_a_client_that_goes_away_stops_its_request(tiny_dirs, tiny_verifier, monkeypatch):
    """Non-streamed: once the HTTP client disconnects, the request's rounds stop at the next one
    and free their slot and sessions; it does not run on to its max_tokens."""
    import http.client
    import socket
    import threading

    import uvicorn

    import coordinator.openai_api as api_module
    from tests.conftest import VerifyGate, free_port, local_stack, tiny_config
    from verifier_service.server import VerifierServicer

    verify_calls = []
    real_verify = VerifierServicer.Verify
    monkeypatch.setattr(VerifierServicer, "Verify", lambda s, request, context: verify_calls.append(1) or real_verify(s, request, context))
    calls = []
    real_init = api_module.ForwardedCall.__init__
    monkeypatch.setattr(api_module.ForwardedCall, "__init__", lambda self, *a, **k: calls.append(self) or real_init(self, *a, **k))
    config = tiny_config(tiny_dirs, num_draft_tokens=0)
    config["limits"] = {"max_concurrent_requests": 1}
    with VerifyGate(monkeypatch, hold=lambda request: True) as gate, local_stack(config) as stack:
        server = uvicorn.Server(uvicorn.Config(_app(stack), host="127.0.0.1", port=free_port(), log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            assert _until(lambda: server.started)
            client = http.client.HTTPConnection("127.0.0.1", server.config.port, timeout=60)
            client.request("POST", "/v1/completions", body='{"prompt": "w1 w2", "max_tokens": 400, "temperature": 0}',
                           headers={"content-type": "application/json"})
            assert gate.wait_held(1)  # the request's first round waits at the verifier
            client.sock.shutdown(socket.SHUT_RDWR)
            client.close()
            assert calls and calls[-1].gone.wait(30), "the coordinator did not notice the client leave"
            gate.open()
            coordinator = stack["coordinator_obj"]
            assert _until(lambda: coordinator.in_flight == 0)
            assert len(verify_calls) == 1  # the round in flight, none after (400 tokens would take 50 calls)
            # Its slot is free: the next request (the only one allowed) is answered in full.
            with TestClient(_app(stack)) as again:
                reply = again.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 5, "temperature": 0})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        finally:
            server.should_exit = True
            thread.join(timeout=30)


def _until(condition, timeout_s: float = 60.0) -> bool:
    """Whether `condition()` came true (the timeout only guards against a hang)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
