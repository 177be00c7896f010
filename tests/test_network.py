"""The user-space link emulator: it delays real bytes on a real socket, caps bandwidth, and
the coordinator's measured wire time sees exactly what it adds."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import ConfigError, config_from_dict
from specdec.serving.latency_proxy import LatencyProxy, LinkSettings
from tests.conftest import local_stack, tiny_config


@pytest.fixture()
def echo_server():
    server = socket.socket()
    server.bind(("localhost", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def echo(conn=conn) -> None:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"localhost:{server.getsockname()[1]}"
    server.close()


def round_trip_ms(sock: socket.socket, size: int) -> float:
    start = time.perf_counter()
    sock.sendall(b"x" * size)
    received = 0
    while received < size:
        received += len(sock.recv(1 << 16))
    return (time.perf_counter() - start) * 1e3


def test_proxy_adds_the_round_trip_time_and_can_be_retuned(echo_server):
    """The same socket through the proxy, with the delay and retuned to none: the delayed round
    trips take at least the delay (it is a sleep), and their gain over the undelayed ones is at
    least half of it (retuning took it away) and under twice it (added once, not each way).
    The fastest of five on each side: a busy machine slows single round trips, not all."""
    rtt = 100.0
    proxy = LatencyProxy(echo_server, LinkSettings(rtt_ms=rtt))
    with socket.create_connection(("localhost", proxy.port)) as sock:
        slow = min(round_trip_ms(sock, 100) for _ in range(5))
        proxy.settings = LinkSettings()
        fast = min(round_trip_ms(sock, 100) for _ in range(5))
    proxy.close()
    assert rtt <= slow, slow
    assert rtt / 2 <= slow - fast < 2 * rtt, (slow, fast)


def test_proxy_caps_bandwidth_and_keeps_order(echo_server):
    proxy = LatencyProxy(echo_server, LinkSettings(bandwidth_mbps=8, jitter_ms=2, rtt_ms=4))
    payload = bytes(range(256)) * 800  # 200 KB: at least 200 ms each way at 1 MB/s
    with socket.create_connection(("localhost", proxy.port)) as sock:
        start = time.perf_counter()
        sock.sendall(payload)
        back = b""
        while len(back) < len(payload):
            back += sock.recv(1 << 16)
        elapsed_ms = (time.perf_counter() - start) * 1e3
    proxy.close()
    assert back == payload, "jitter must never reorder bytes"
    assert elapsed_ms >= 200


def test_coordinator_measures_the_injected_latency(tiny_dirs):
    rtt = 20.0
    config = tiny_config(tiny_dirs, num_draft_tokens=2)
    config["coordinator"]["network"] = {"drafter": {"rtt_ms": rtt}, "verifier": {"rtt_ms": rtt}}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        # A fixed budget, so most rounds speculate; a fused round (the verifier alone) calls no drafter.
        stats = client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=12, adaptive=False)).stats
        client.close()
    speculative = stats.rounds - stats.plan_rounds.get("fused", 0)
    assert speculative > 0
    # Every round calls the verifier; a speculative round also calls the drafter.
    assert stats.wire_serialization_ms >= (stats.rounds + speculative) * rtt
    assert stats.draft_wire_ms >= speculative * rtt and stats.verify_wire_ms >= stats.rounds * rtt
    assert stats.draft_wire_ms + stats.verify_wire_ms == pytest.approx(stats.wire_serialization_ms)


@pytest.mark.parametrize(
    "link,phrase",
    [
        ({"rtt_ms": -1}, "coordinator.network.drafter: rtt_ms must be a finite number >= 0"),
        ({"jitter_ms": float("inf")}, "coordinator.network.drafter: jitter_ms must be a finite number >= 0"),
        ({"bandwidth_mbps": "fast"}, "coordinator.network.drafter.bandwidth_mbps must be a valid number"),
    ],
)
def test_bad_link_settings_are_refused(link, phrase):
    with pytest.raises(ConfigError, match=phrase):
        config_from_dict({"coordinator": {"network": {"drafter": link}}})


def test_link_settings_check_themselves_wherever_they_are_made():
    with pytest.raises(ValueError, match="rtt_ms must be a finite number >= 0, got -5"):
        LinkSettings(rtt_ms=-5)


def test_sweep_policies_and_checks_compare_like_with_like():
    """The sweep runs every policy the issue lists (plus overlapped fixed chains) and its checks
    divide the right rows: adaptive by the best fixed policy and by fused, overlap on by off."""
    from specdec.bench.network import format_sweep, sweep_checks, sweep_policies

    policies = dict(sweep_policies([1, 2, 4, 8], [16, 32], "rsd-s", [4]))
    assert list(policies) == [
        "chain-1", "chain-2", "chain-4", "chain-8", "chain-4+overlap", "rsd-s-16", "rsd-s-32", "fused", "adaptive", "adaptive+overlap",
    ]
    assert policies["chain-4+overlap"]["overlap"] and not policies["chain-4"]["overlap"] and policies["rsd-s-16"]["tree"].method == "rsd-s"
    # Chains are chains whatever the config's default tree (the sweep once ran dynamic trees under their names).
    assert policies["chain-4"]["tree"].method == policies["chain-4+overlap"]["tree"].method == "chain"
    assert policies["fused"]["num_draft_tokens"] == 0 and policies["adaptive+overlap"] == {"adaptive": True, "overlap": True}

    speeds = {"chain-4": 5.0, "chain-4+overlap": 6.0, "rsd-s-16": 4.0, "fused": 10.0, "adaptive": 9.6, "adaptive+overlap": 9.0}
    rows = [{"rtt_ms": 20.0, "temperature": 0.0, "policy": p, "tokens_per_second": v, "wire_share": 0.1} for p, v in speeds.items()]
    (check,) = sweep_checks(rows)
    assert check["best_fixed"] == "fused"
    assert check["adaptive_vs_best_fixed"] == pytest.approx(0.96) and check["adaptive_vs_fused"] == pytest.approx(0.96)
    assert check["overlap_on_vs_off"] == pytest.approx(9.0 / 9.6)
    assert check["fixed_overlap_on_vs_off"] == {"chain-4+overlap": pytest.approx(1.2)}
    table = format_sweep(
        {"results": [{**r, "mean_accepted_per_round": None, "mean_budget": 0.0, "overlap_hits": 0} for r in rows], "checks": [check]}
    )
    assert "| 20 | - | 0 | fused | 0.96 | 0.96 | 0.94 | chain-4: 1.20 |" in table


def test_concurrency_checks_read_scaling_adaptive_share_and_exactness():
    """The concurrency bench's bars, on rows as `specdec bench --concurrency` writes them."""
    from specdec.bench.concurrency import concurrency_checks, format_concurrency

    rows = [
        {"concurrency": n, "policy": p, "tokens_per_second": tps, "burst_tokens_per_second": bursts, "request_s": {"p50": 1.0, "p99": 2.0},
         "ms_per_token": {"p50": 10.0, "p99": 20.0}, "plan_rounds": {"fused": 8}}
        for n, p, tps, bursts in [
            (1, "verifier-alone", 100.0, [90.0, 110.0]), (1, "chain-4", 80.0, [80.0, 80.0]), (1, "adaptive", 96.0, [88.0, 105.0]),
            (32, "verifier-alone", 310.0, [310.0, 310.0]), (32, "chain-4", 90.0, [90.0, 90.0]), (32, "adaptive", 250.0, [250.0, 250.0]),
        ]
    ]
    checks = {c["check"]: c for c in concurrency_checks(rows, mismatches=[{"concurrency": 32, "policy": "adaptive", "prompt": 0}])}
    assert not checks["greedy outputs equal to each prompt decoded alone"]["passed"]
    assert checks["verifier-alone: aggregate at 32 streams >= 3x at 1"]["passed"]
    assert not checks["adaptive: aggregate at 32 streams >= 3x at 1"]["passed"]
    at_one = checks["adaptive >= 95% of the best fixed policy at 1 streams"]
    # Paired by turn, against the best fixed policy by totals (the verifier alone here).
    assert at_one["passed"] and at_one["best_fixed"] == "verifier-alone"
    assert at_one["value"] == pytest.approx((88 / 90 * 105 / 110) ** 0.5)
    assert at_one["interval"][0] <= at_one["value"] <= at_one["interval"][1]
    assert checks["adaptive >= 95% of the best fixed policy at 32 streams"]["value"] == pytest.approx(250 / 310)
    table = format_concurrency({"results": rows, "checks": list(checks.values())})
    assert "FAIL  adaptive >= 95% of the best fixed policy at 32 streams (0.81 [0.81, 0.81] paired by wave; totals 0.81)" in table
    assert "     1  verifier-alone     100.0        90-110" in table  # each burst's rate: the machine's drift shows


def test_concurrency_turns_let_each_policy_follow_every_other_alike():
    from collections import Counter

    from specdec.bench.concurrency import turns

    names = ["alone", "fixed", "adaptive"]
    sequence = turns(names, 6)
    assert all(sorted(turn) == sorted(names) for turn in sequence) and len(set(sequence)) == 6
    order = [policy for turn in sequence for policy in turn]
    follows = Counter(zip(order, order[1:]))
    assert all(a != b for a, b in follows)  # no policy runs twice in a row
    after_fixed = Counter(b for a, b in zip(order, order[1:]) if a == "fixed")
    assert abs(after_fixed["adaptive"] - after_fixed["alone"]) <= 1  # a rotation: 5 to 0


def test_methods_take_every_place_in_the_turn_order_alike():
    from collections import Counter

    from specdec.bench.stats import turn_order

    methods = ["alone", "dynamic-4", "adaptive", "hf"]
    orders = [turn_order(methods, i) for i in range(8)]
    assert all(sorted(order) == sorted(methods) for order in orders)
    places = Counter((place, method) for order in orders for place, method in enumerate(order))
    assert set(places.values()) == {2}  # 8 prompts: each method twice in each of the 4 places
