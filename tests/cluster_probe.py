"""Run by tests/test_cluster.py in a fresh process (Ray caches its auth mode per process):
deploys the app on a running Ray cluster the way `specdec serve --ray-address` does, then
prints, as JSON on a line that starts `PROBE `, where each replica runs, the client address it
gave, one greedy answer, the replicas' own metric calls and what a plaintext call to each
service gets.

    python tests/cluster_probe.py RAY_ADDRESS CONFIG_JSON PORT"""
from __future__ import annotations

import json
import sys


def main() -> None:
    address, config, port = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    import ray
    from ray import serve

    import grpc

    from specdec.serving.client import CoordinatorClient, generate_request
    from specdec.app.launch import start_stack
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE
    from specdec.v1 import common_pb2

    client_address = start_stack(config, port, ray_address=address, proxies=False)
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    placement, node_address = {}, {}
    for actor in ray._private.state.actors().values():  # the state API needs the dashboard; the GCS table does not
        name = actor.get("ActorClassName", "")
        if actor["State"] == "ALIVE" and name.startswith("ServeReplica:"):
            node = nodes[actor["Address"]["NodeID"]]
            placement[name.rsplit(":", 1)[1]] = {k: v for k, v in node["Resources"].items() if k.endswith("_node")}
            node_address[name.rsplit(":", 1)[1]] = node["NodeManagerAddress"]
    client = CoordinatorClient(client_address)
    reply = client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=24, num_draft_tokens=3))
    client.close()
    handles = {name: serve.get_deployment_handle(name, app_name="specdec") for name in ("Verifier", "Drafter")}
    own_calls = {name: handle.record_autoscaling_stats.remote().result() for name, handle in handles.items()}
    plaintext = {}  # a call to a service without the app's TLS: refused
    for name, service in (("Verifier", VERIFIER_SERVICE), ("Drafter", DRAFTER_SERVICE)):
        caller = MeasuredClient(handles[name].address.remote().result(), service)
        try:
            caller.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=10)
            plaintext[name] = "OK"
        except grpc.RpcError as err:
            plaintext[name] = err.code().name
        caller.close()
    print("PROBE " + json.dumps({
        "placement": placement, "client_address": client_address, "node_address": node_address, "token_ids": list(reply.token_ids),
        "speculative_rounds": reply.stats.speculative_rounds,
        "draft_wire_ms": reply.stats.draft_wire_ms, "verify_wire_ms": reply.stats.verify_wire_ms, "own_calls": own_calls,
        "plaintext": plaintext,
    }), flush=True)
    serve.shutdown()


if __name__ == "__main__":
    main()
