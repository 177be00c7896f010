"""A real multi-node Ray cluster on this machine, built the way a user builds one (`ray start`
for a head and two worker nodes, each worker advertising the resource its model service asks
for, as deploy/kuberay/rayservice.yaml does): each replica runs on the node that advertises its
resource (read from Ray's actor table, not assumed), and the output equals the verifier alone's.
The nodes share this machine's address (no network namespaces here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.core.models import hf_greedy
from specdec.serving.client import CoordinatorClient, generate_request
from tests.conftest import free_port, tiny_config

RAY = str(Path(sys.executable).with_name("ray"))
PLACEMENT = {"Coordinator": "coordinator_node", "Verifier": "verifier_node", "Drafter": "drafter_node"}


def _ray(*args: str) -> None:
    subprocess.run([RAY, *args, "--disable-usage-stats"] if args[0] == "start" else [RAY, *args], check=True, capture_output=True, timeout=180)


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    monkeypatch_module.setenv("RAY_AUTH_MODE", "token")  # Ray's default for a head started with `ray start`
    address = f"127.0.0.1:{free_port()}"
    _ray("start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=0", '--resources={"coordinator_node": 1}', "--include-dashboard=false")
    try:
        for resource in ("verifier_node", "drafter_node"):
            _ray("start", f"--address={address}", "--num-cpus=1", f'--resources={{"{resource}": 1}}')
        yield address
    finally:
        import ray

        if ray.is_initialized():
            from specdec.serving.launch import stop_stack

            stop_stack()
        _ray("stop", "--force")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def replica_nodes() -> dict[str, dict[str, float]]:
    """Each live replica's deployment -> the custom resources of the node it runs on."""
    import ray

    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    found = {}
    for actor in ray._private.state.actors().values():
        name = actor.get("ActorClassName", "")
        if actor["State"] == "ALIVE" and name.startswith("ServeReplica:"):
            found[name.rsplit(":", 1)[1]] = {k: v for k, v in nodes[actor["Address"]["NodeID"]].items() if k.endswith("_node")}
    return found


@pytest.mark.e2e
def test_each_replica_runs_on_the_node_of_its_resource_and_the_output_is_exact(cluster, tiny_dirs, tiny_verifier):
    from specdec.serving.launch import start_stack

    port = free_port()
    config = tiny_config(tiny_dirs, port=port)
    for section, deployment in (("verifier", "Verifier"), ("drafter", "Drafter"), ("coordinator", "Coordinator")):
        config.setdefault(section, {})["ray_actor_options"] = {"num_cpus": 0, "resources": {PLACEMENT[deployment]: 0.01}}
    address = start_stack(config, port, ray_address=cluster, proxies=False)
    where = replica_nodes()
    assert set(where) == set(PLACEMENT), where
    for deployment, resource in PLACEMENT.items():
        assert where[deployment] == {resource: 1.0}, (deployment, where[deployment])
    client = CoordinatorClient(address)
    reply = client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=24, num_draft_tokens=3))
    client.close()
    assert list(reply.token_ids) == hf_greedy(tiny_verifier, [1, 4, 5], 24)
    assert reply.stats.speculative_rounds > 0 and reply.stats.verify_wire_ms > 0 and reply.stats.draft_wire_ms > 0
