"""Node loss on a real multi-node Ray cluster on this machine (specdec/bench/cluster.py): a head
(the coordinator's node) and two worker nodes started with `ray start`, one advertising
`verifier_node`, one `drafter_node`, each in a network namespace of its own where root can make
one, the app deployed on them as `specdec serve --ray-address` does. A node is lost the way a
machine is: its raylet and every process of it killed at once (SIGKILL).

1. The drafter's node is lost while greedy streams run: every stream must complete with the
   verifier alone's tokens, and health must stay SERVING.
2. A drafter node joins again: the time until a request speculates again, without a restart.
3. The verifier's node is lost: the time until health says NOT_SERVING, and how a new request
   fails (code, message, how long it took).
4. A verifier node joins again: the time until health says SERVING and a request succeeds,
   exactly.

    .venv/bin/python scripts/node_loss.py --out docs/benchmarks/node_loss.json

Default models and config unless --config; the figures include Ray's own detection of a dead
node (its GCS health checks) and Serve's start of a replacement replica.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.bench.cluster import LocalCluster, free_port

PROMPTS = ["Explain how a hash map works.", "Write a short poem about rivers.", "List three uses of copper.", "What is a prime number?"]


class Health:
    """Polls the coordinator's gRPC health every 50 ms and keeps every change with its time."""

    def __init__(self, address: str):
        self._stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        self.changes: list[tuple[float, str]] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    self._stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                )
            except grpc.RpcError as err:
                status = err.code().name
            if not self.changes or self.changes[-1][1] != status:
                self.changes.append((time.monotonic(), status))
            time.sleep(0.05)

    def seen(self, start: float, end: float) -> list[str]:
        """The statuses health said from `start` to `end`, in order."""
        before = [s for t, s in self.changes if t < start][-1:]
        return before + [s for t, s in self.changes if start <= t <= end]

    def wait_for(self, status: str, since: float, timeout_s: float) -> float | None:
        """Seconds from `since` until health first said `status` after it; None = not within timeout_s."""
        while time.monotonic() < since + timeout_s:
            hit = next((t for t, s in self.changes if t >= since and s == status), None)
            if hit is not None:
                return hit - since
            time.sleep(0.05)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (default: the built-in defaults)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=2, help="greedy streams running when the drafter's node is lost")
    parser.add_argument("--out", default="docs/benchmarks/node_loss.json")
    args = parser.parse_args()

    with LocalCluster({"coordinator_node": 1}) as cluster:  # before Ray is imported
        from specdec.serving.client import CoordinatorClient, generate_request
        from specdec.v1 import common_pb2

        cluster.start_service_nodes()
        client_address = cluster.deploy({"config_file": args.config} if args.config else {}, free_port())
        client = CoordinatorClient(client_address)
        health = Health(client_address)
        speculative = dict(
            max_new_tokens=args.max_new_tokens, num_draft_tokens=4, tree=common_pb2.TreeShape(method="chain"), adaptive=False
        )

        def ask(prompt: str, timeout: float = 120.0, **fields):
            request = generate_request(prompt, use_chat_template=True, **{**speculative, **fields})
            return client.generate(request, timeout=timeout)

        reference = {p: list(ask(p, num_draft_tokens=0).token_ids) for p in PROMPTS}
        result: dict = {"machine": "2 CPU cores; three Ray nodes (ray start) on one machine", "prompts": len(PROMPTS),
                        "max_new_tokens": args.max_new_tokens, "own_network_namespaces": cluster.isolated, "client_address": client_address}

        # 1. The drafter's node is lost mid-stream.
        outcomes: list[dict] = []

        def stream(index: int) -> None:
            for prompt in PROMPTS[index::args.streams]:
                try:
                    reply = ask(prompt)
                    stats = reply.stats
                    outcomes.append({"exact": list(reply.token_ids) == reference[prompt], "rounds": stats.speculative_rounds,
                                     "drafter_failures": stats.drafter_failures})
                except grpc.RpcError as err:
                    outcomes.append({"error": f"{err.code().name}: {err.details()}"})

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        lost = time.monotonic()
        result["drafter_node_processes_killed"] = cluster.kill_node("drafter_node")
        for thread in threads:
            thread.join()
        result["drafter_loss"] = {
            "requests": len(outcomes), "exact": sum(o.get("exact", False) for o in outcomes),
            "errors": [o["error"] for o in outcomes if "error" in o], "speculative_rounds": [o.get("rounds") for o in outcomes],
            "lost_their_drafter_mid_stream": sum(bool(o.get("rounds") and o.get("drafter_failures")) for o in outcomes),
            "health": health.seen(lost, time.monotonic()),
        }

        # 2. A drafter node joins again.
        joined = time.monotonic()
        cluster.start_node("drafter_node")
        node_up, rounds, exact = time.monotonic() - joined, 0, True
        while time.monotonic() < joined + 300 and not rounds:
            reply = ask(PROMPTS[0])
            rounds, exact = reply.stats.speculative_rounds, exact and list(reply.token_ids) == reference[PROMPTS[0]]
        result["drafter_rejoin"] = {"node_start_s": round(node_up, 1),
                                    "speculating_again_s": round(time.monotonic() - joined, 1) if rounds else None,
                                    "exact_meanwhile": exact}

        # 3. The verifier's node is lost.
        lost = time.monotonic()
        result["verifier_node_processes_killed"] = cluster.kill_node("verifier_node")
        not_serving = health.wait_for("NOT_SERVING", lost, 120)
        asked = time.monotonic()
        try:
            ask(PROMPTS[1], timeout=30)
            failure = {"code": "OK"}
        except grpc.RpcError as err:
            failure = {"code": err.code().name, "message": err.details()}
        failure["after_s"] = round(time.monotonic() - asked, 2)
        result["verifier_loss"] = {"not_serving_after_s": None if not_serving is None else round(not_serving, 2), "new_request": failure}

        # 4. A verifier node joins again.
        joined = time.monotonic()
        cluster.start_node("verifier_node")
        node_up = time.monotonic() - joined
        serving = health.wait_for("SERVING", joined, 300)
        reply = ask(PROMPTS[1])
        result["verifier_rejoin"] = {
            "node_start_s": round(node_up, 1), "serving_after_s": None if serving is None else round(serving, 1),
            "first_request_exact": list(reply.token_ids) == reference[PROMPTS[1]],
            "first_request_done_s": round(time.monotonic() - joined, 1),
        }
        result["health_changes"] = [(round(t - health.changes[0][0], 2), s) for t, s in health.changes]
        client.close()
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
