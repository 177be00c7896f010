"""Faults under Ray Serve, with tiny models: a killed replica comes back on a new port, and the
coordinator finds it there (it asks Serve again), so requests survive or recover exactly."""
from __future__ import annotations

import time

import grpc
import pytest

from specdec.core.models import hf_greedy
from specdec.serving.client import CoordinatorClient, generate_request
from tests.conftest import free_port, tiny_config

PROMPT = [3, 7, 5, 9]


def test_a_stack_on_another_port_than_its_config_says_is_refused_at_once(tiny_dirs):
    from specdec.app.launch import deploy

    with pytest.raises(ValueError, match="coordinator.port is 50051, not 50061"):
        deploy(tiny_config(tiny_dirs), 50061)


@pytest.fixture(scope="module")
def serve_stack(tiny_dirs):
    from specdec.app.launch import start_stack, stop_stack

    port = free_port()
    link = {"rtt_ms": 10}  # slow rounds down, so a replica can be killed mid-stream
    config = tiny_config(tiny_dirs, port=port, network={"drafter": link, "verifier": link})
    address = start_stack(config, port, proxies=False)
    client = CoordinatorClient(address)
    yield client
    client.close()
    stop_stack()


def _kill(deployment: str) -> None:
    """Kills the deployment's replica process; Serve starts another, which binds a new port."""
    import ray

    [replica] = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]]
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)


def _within(seconds: float, attempt):
    """attempt() until it returns something truthy (UNAVAILABLE meanwhile is expected)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            result = attempt()
            if result:
                return result
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "no recovery in time"
        time.sleep(1.0)


@pytest.mark.e2e
def test_a_killed_drafter_replica_costs_no_request_and_speculation_returns(serve_stack, tiny_verifier):
    expected = hf_greedy(tiny_verifier, PROMPT, 60)
    stream = serve_stack.stream(generate_request(prompt_token_ids=PROMPT, max_new_tokens=60, num_draft_tokens=3))
    parts = [next(stream)]
    _kill("Drafter")
    parts += list(stream)
    assert [t for p in parts for t in p.token_ids] == expected
    assert parts[-1].stats.drafter_failures >= 1

    def speculating():
        reply = serve_stack.generate(generate_request(prompt_token_ids=PROMPT, max_new_tokens=20, num_draft_tokens=3))
        assert list(reply.token_ids) == expected[:20]
        return reply.stats.drafter_failures == 0 and reply.stats.speculative_rounds > 0

    _within(90, speculating)  # the new replica, on its new port, drafts again


@pytest.mark.e2e
def test_a_killed_verifier_replica_is_found_again_and_the_output_stays_exact(serve_stack, tiny_verifier):
    expected = hf_greedy(tiny_verifier, PROMPT, 30)
    before = serve_stack.generate(generate_request(prompt_token_ids=PROMPT, max_new_tokens=30))
    assert list(before.token_ids) == expected
    _kill("Verifier")
    started = time.monotonic()
    reply = _within(90, lambda: serve_stack.generate(generate_request(prompt_token_ids=PROMPT, max_new_tokens=30), timeout=30))
    assert list(reply.token_ids) == expected
    assert reply.stats.verifier_replica != before.stats.verifier_replica  # served by the new replica, on its new port
    print(f"served again {time.monotonic() - started:.1f} s after the kill")


@pytest.mark.e2e
def test_a_coordinator_running_the_verifier_serves_exactly_under_serve(serve_stack, tiny_dirs, tiny_verifier):
    """coordinator.verifier_in_process under Ray Serve: the application has no Verifier
    deployment, the coordinator replica runs the verifier, and rounds still cross to the
    drafter's replica."""
    from ray import serve

    from specdec.app.launch import deploy

    port = free_port()
    address = deploy(tiny_config(tiny_dirs, port=port, verifier_in_process=True), port, name="colocated")
    try:
        deployments = set(serve.status().applications["colocated"].deployments)
        assert deployments == {"Coordinator", "Drafter"}, deployments
        client = CoordinatorClient(address)
        reply = client.generate(generate_request(prompt_token_ids=PROMPT, max_new_tokens=30, num_draft_tokens=3))
        client.close()
        assert list(reply.token_ids) == hf_greedy(tiny_verifier, PROMPT, 30)
        assert reply.stats.verifier_replica.startswith("in-process:") and reply.stats.speculative_rounds > 0
        assert not reply.stats.drafter_replica.startswith("in-process:")
        # The coordinator replica reports the verifier's sessions it holds, for SessionsPolicy autoscaling.
        coordinator = serve.get_deployment_handle("Coordinator", app_name="colocated")
        assert coordinator.record_autoscaling_stats.remote().result() == {"sessions": 0.0}  # the request ended its session
    finally:
        serve.delete("colocated")

