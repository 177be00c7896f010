"""A real multi-node Ray cluster on this machine, built the way a user builds one (`ray start`
for a head and two worker nodes, each worker advertising the resource its model service asks
for, as deploy/kuberay/rayservice.yaml does; specdec/bench/cluster.py), each worker node in a
network namespace of its own with its own address where root can make one: each replica runs on
the node that advertises its resource (read from Ray's actor table, not assumed), the client
address is the coordinator node's, the output equals the verifier alone's, and the links inside
are mutual TLS without being asked (the app makes its certificates on a cluster): a plaintext
call to a service is refused, while each replica's own calls to itself pass."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.bench.cluster import RAY_ENV, LocalCluster, free_port
from specdec.core.models import hf_greedy
from tests.conftest import tiny_config

PLACEMENT = {"Coordinator": "coordinator_node", "Verifier": "verifier_node", "Drafter": "drafter_node"}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster({"coordinator_node": 1}) as cluster:
        cluster.start_service_nodes()
        yield cluster


@pytest.mark.e2e
def test_each_replica_runs_on_the_node_of_its_resource_over_mutual_tls(cluster, tiny_dirs, tiny_verifier):
    port = free_port()
    config = tiny_config(tiny_dirs, port=port)
    for section, deployment in (("verifier", "Verifier"), ("drafter", "Drafter"), ("coordinator", "Coordinator")):
        config[section]["ray_actor_options"] = {"num_cpus": 0, "resources": {PLACEMENT[deployment]: 0.01}}
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cluster_probe.py")), cluster.address, json.dumps(config), str(port)],
        capture_output=True, text=True, timeout=600, env=RAY_ENV, cwd=Path(__file__).parent.parent,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    [line] = [line for line in probe.stdout.splitlines() if line.startswith("PROBE ")]
    found = json.loads(line.removeprefix("PROBE "))
    assert found["placement"] == {deployment: {resource: 1.0} for deployment, resource in PLACEMENT.items()}, found["placement"]
    assert found["client_address"] == f"{found['node_address']['Coordinator']}:{port}"  # what `specdec serve --ray-address` prints
    if cluster.isolated:  # three nodes, three addresses: the rounds crossed the bridge between them
        assert len(set(found["node_address"].values())) == 3, found["node_address"]
    assert found["token_ids"] == hf_greedy(tiny_verifier, [1, 4, 5], 24)
    assert found["speculative_rounds"] > 0 and found["draft_wire_ms"] > 0 and found["verify_wire_ms"] > 0
    assert found["own_calls"] == {"Verifier": {"sessions": 0.0}, "Drafter": {"sessions": 0.0}}
    assert found["plaintext"] == {"Verifier": "UNAVAILABLE", "Drafter": "UNAVAILABLE"}
