"""Several replicas of each service: sessions spread over them and stay where they opened; a
replica that goes away costs no request (its sessions re-open on another, exactly); Serve
scales the model services by the sessions they hold."""
from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest

from coordinator.clients import Replicas
from specdec.core.models import hf_greedy
from specdec.serving.autoscaling import SessionsPolicy, replicas_for
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import config_from_dict
from specdec.app.launch import APP_NAME
from tests.conftest import free_port, tiny_config

PROMPTS = [[1, 3, 4, 5], [1, 7], [1, 4, 4, 9, 12, 0], [1, 11, 3, 8, 8, 2, 5, 6], [2, 5, 9], [1, 6, 6, 3, 10]]


class Replica:
    """A replica seen from the coordinator: what Replicas asks of a client."""

    def __init__(self, address: str):
        self.address, self.answering, self.closed = address, True, False

    def reachable(self, timeout_s: float = 2.0) -> bool:
        return self.answering

    def close(self) -> None:
        self.closed = True


def replica_set(members: dict[str, str], discover=None) -> tuple[Replicas, dict[str, Replica]]:
    made: dict[str, Replica] = {}

    def connect(address: str):
        made[address] = Replica(address)
        return made[address], None

    return Replicas("verifier", members, connect, discover, linger_s=0.0), made


# Placement, on its own.


def test_new_sessions_go_to_the_least_loaded_replica_and_stay_there():
    replicas, _ = replica_set({"a": "host:1", "b": "host:2", "c": "host:3"})
    placed = [replicas.bind(f"s{i}")[0] for i in range(9)]
    assert sorted(placed) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert [replicas.bind(f"s{i}")[0] for i in range(9)] == placed  # affinity: the same replica every call
    for i in range(3):
        replicas.release(f"s{i}")
    freed = {placed[i] for i in range(3)}
    assert replicas.bind("new")[0] in freed


def test_ties_are_broken_by_the_session_not_by_order():
    picks = set()
    for i in range(40):
        replicas, _ = replica_set({"a": "host:1", "b": "host:2"})
        picks.add(replicas.bind(f"session-{i}")[0])
    assert picks == {"a", "b"}


def test_a_session_moves_when_its_replica_leaves_or_stops_answering():
    members = {"a": "host:1", "b": "host:2", "c": "host:3"}
    replicas, clients = replica_set(dict(members), discover=lambda: dict(members))
    on = {f"s{i}": replicas.bind(f"s{i}")[0] for i in range(6)}
    del members["a"]  # a leaves the directory
    replicas.failed("a")
    moved = {s: replicas.bind(s)[0] for s, key in on.items() if key == "a"}
    assert moved and all(key in ("b", "c") for key in moved.values())
    assert all(replicas.bind(s)[0] == key for s, key in on.items() if key != "a")  # the others stay
    assert clients["host:1"].closed  # closed once it lingered (0 s here): calls in flight may finish first
    clients["host:2"].answering = False  # b is listed but does not answer
    replicas.failed("b")
    assert all(replicas.bind(s)[0] == "c" for s in on)
    clients["host:2"].answering = True
    assert replicas.check()
    assert replicas.bind("fresh")[0] == "b"  # back, and the least loaded


def test_the_only_replica_is_kept_while_it_is_down():
    replicas, clients = replica_set({"a": "host:1"})
    replicas.bind("s")
    clients["host:1"].answering = False
    replicas.failed("a")
    assert replicas.bind("s")[0] == "a"  # nowhere to go: keep retrying it until it is back
    assert not replicas.check()


def test_the_sessions_policy_asks_for_replicas_by_the_sessions_they_hold():
    policy = SessionsPolicy(target_sessions=8)
    ctx = SimpleNamespace(aggregated_metrics={"sessions": {"r1": 10.0, "r2": 9.0}})
    assert policy(ctx)[0] == 3
    assert policy(SimpleNamespace(aggregated_metrics={}))[0] == 1  # no sessions yet: keep one warm
    assert [replicas_for(n, 16) for n in (0, 1, 16, 17, 64)] == [1, 1, 1, 2, 4]
    with pytest.raises(ValueError, match="target_sessions"):
        SessionsPolicy(target_sessions=0)


def test_scaling_settings_are_checked_at_load():
    config = config_from_dict({"verifier": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}, "drafter": {"num_replicas": 2}})
    assert config.verifier.autoscaling["max_replicas"] == 4 and config.drafter.num_replicas == 2
    for bad, match in [
        ({"verifier": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}}, "verifier.autoscaling"),
        ({"drafter": {"autoscaling": {"max_replica": 2}}}, "unknown key drafter.autoscaling.max_replica"),
        ({"coordinator": {"num_replicas": 0}}, "coordinator.num_replicas"),
    ]:
        with pytest.raises(ValueError, match=match):
            config_from_dict(bad)


# Real services: two of each, plain gRPC servers in this process.


def run_streams(client: CoordinatorClient, prompts, max_new_tokens: int, between=None):
    """Opens one stream per prompt, reads each stream's first message (every session is then
    open on its replicas), calls `between()`, and reads the rest; returns (tokens, final stats)."""
    streams = [client.stream(generate_request(prompt_token_ids=p, max_new_tokens=max_new_tokens, num_draft_tokens=3)) for p in prompts]
    parts = [[next(stream)] for stream in streams]
    if between is not None:
        between()
    results = [None] * len(streams)

    def drain(i: int) -> None:
        parts[i] += list(streams[i])
        results[i] = ([t for p in parts[i] for t in p.token_ids], parts[i][-1].stats)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_two_replicas_of_each_share_the_sessions_and_one_leaving_costs_no_request(tiny_dirs, tiny_verifier):
    import coordinator.server
    import drafter_service.server
    import verifier_service.server

    link = {"rtt_ms": 20}  # rounds slow enough that the replicas stop mid-stream
    config = config_from_dict(tiny_config(tiny_dirs, network={"drafter": link, "verifier": link}))
    config.coordinator.port = 0
    verifiers = [verifier_service.server.start(config.verifier, **config.service_args("verifier")) for _ in range(2)]
    drafters = [drafter_service.server.start(config.drafter, **config.service_args("drafter")) for _ in range(2)]
    addresses = {name: ",".join(f"localhost:{port}" for _, port in servers) for name, servers in (("v", verifiers), ("d", drafters))}
    c_server, c_port, coord = coordinator.server.start(config, addresses["d"], addresses["v"])
    client = CoordinatorClient(f"localhost:{c_port}")
    expected = [hf_greedy(tiny_verifier, p, 40) for p in PROMPTS]
    try:
        results = run_streams(client, PROMPTS, 40)
        assert [tokens for tokens, _ in results] == expected  # no cross-talk between sessions of one replica
        assert {stats.verifier_replica for _, stats in results} == set(addresses["v"].split(","))
        assert {stats.drafter_replica for _, stats in results} == set(addresses["d"].split(","))

        def one_of_each_goes():
            verifiers[0][0].stop(grace=None)
            drafters[1][0].stop(grace=None)

        results = run_streams(client, PROMPTS, 40, between=one_of_each_goes)
        assert [tokens for tokens, _ in results] == expected
        assert {stats.verifier_replica for _, stats in results} == {f"localhost:{verifiers[1][1]}"}
        assert {stats.drafter_replica for _, stats in results} - {""} == {f"localhost:{drafters[0][1]}"}
        assert sum(stats.replica_moves for _, stats in results) >= len(PROMPTS) // 2
    finally:
        client.close()
        c_server.stop(grace=None)
        coord.pair.close()
        for server, _ in verifiers + drafters:
            server.stop(grace=None)


# Under Ray Serve.


def deploy_declaratively(config: dict, deployments: list[dict]) -> None:
    """What `serve deploy` with deploy/serve.yaml does: the app from its import path, with
    Serve's own `deployments:` settings, which change in place (a change of `args` restarts
    the application)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    app = {
        "name": APP_NAME, "route_prefix": "/", "import_path": "specdec.app:build_app", "args": config, "deployments": deployments
    }
    _get_global_client().deploy_apps(ServeDeploySchema(proxy_location="Disabled", applications=[app]))


@contextlib.contextmanager
def serve_app(config: dict, deployments: list[dict]):
    from ray import serve

    from specdec.app.launch import start_local_ray, stop_stack
    from specdec.serving.rpc import wait_until_serving

    config["coordinator"]["auth"] = {"service_token": "t"}  # a random one per deploy would change the args
    start_local_ray()
    try:
        serve.start(proxy_location="Disabled")
        deploy_declaratively(config, deployments)
        wait_until_serving(f"localhost:{config['coordinator']['port']}", 300)
        client = CoordinatorClient(f"localhost:{config['coordinator']['port']}")
        yield client
        client.close()
    finally:
        stop_stack()


@pytest.mark.slow  # 140 s of Serve autoscaling; sessions shared across replicas run in CI (test_two_replicas_...)
def test_under_serve_replicas_scale_by_sessions_share_them_and_scaling_down_costs_no_request(tiny_dirs, tiny_verifier):
    """One app, as `serve deploy` runs it: two coordinators, two drafters, and a verifier that
    SessionsPolicy grows from one replica to two under load. Then an in-place scale-down to one
    of each, mid-stream."""
    from ray import serve

    link = {"rtt_ms": 50}  # rounds slow enough that scaling lands mid-stream
    config = tiny_config(tiny_dirs, port=free_port(), network={"drafter": link, "verifier": link}, num_replicas=2)
    policy = {"policy_function": "specdec.serving.autoscaling:SessionsPolicy", "policy_kwargs": {"target_sessions": 2}}
    scaling = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 600, "metrics_interval_s": 0.5,
               "look_back_period_s": 2, "policy": policy}
    expected = [hf_greedy(tiny_verifier, p, 100) for p in PROMPTS]

    def verifier_replicas() -> int:
        return serve.status().applications[APP_NAME].deployments["Verifier"].replica_states.get("RUNNING", 0)

    def spread_over(client: CoordinatorClient, replicas: int) -> None:
        """New sessions (exact) until they use `replicas` replicas of each service: the
        coordinators learn of replicas come and gone from the directory, read every 2 s (60 s:
        a hang guard)."""
        deadline, spread, each = time.monotonic() + 60, None, {"verifier": replicas, "drafter": replicas}
        while spread != each and time.monotonic() < deadline:
            results = run_streams(client, PROMPTS, 20)
            assert [tokens for tokens, _ in results] == [e[:20] for e in expected]
            spread = {service: len({getattr(stats, f"{service}_replica") for _, stats in results}) for service in each}
        assert spread == each

    with serve_app(config, [{"name": "Drafter", "num_replicas": 2}, {"name": "Verifier", "autoscaling_config": scaling}]) as client:
        assert verifier_replicas() == 1
        # 6 sessions want 3 replicas of 2 sessions: Serve asks for its max, 2. Streams run until
        # it has them (180 s: a hang guard).
        deadline = time.monotonic() + 180
        while verifier_replicas() < 2 and time.monotonic() < deadline:
            results = run_streams(client, PROMPTS, 100)
            assert [tokens for tokens, _ in results] == expected
        assert verifier_replicas() == 2
        spread_over(client, 2)  # new sessions spread over both replicas of each

        # Down to one of each; the autoscaling policy stays (a policy change restarts the app).
        one = [{"name": "Drafter", "num_replicas": 1}, {"name": "Verifier", "autoscaling_config": scaling | {"max_replicas": 1}}]
        results = run_streams(client, PROMPTS, 100, between=lambda: deploy_declaratively(config, one))
        assert [tokens for tokens, _ in results] == expected  # the coordinators stayed; moved sessions stayed exact
        assert sum(stats.replica_moves for _, stats in results) >= 1
        spread_over(client, 1)
