"""A real multi-node Ray cluster on this machine, built the way a user builds one (`ray start`
for a head and two worker nodes, each worker advertising the resource its model service asks
for, as deploy/kuberay/rayservice.yaml does), with the links inside on mutual TLS: each replica
runs on the node that advertises its resource (read from Ray's actor table, not assumed), the
output equals the verifier alone's, and each replica's own calls to itself pass TLS too. The
nodes share this machine's address (no network namespaces here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.core.models import hf_greedy
from tests.certs import make_certificates, service_tls
from tests.conftest import free_port, tiny_config

RAY = str(Path(sys.executable).with_name("ray"))
PLACEMENT = {"Coordinator": "coordinator_node", "Verifier": "verifier_node", "Drafter": "drafter_node"}
# `ray start --head` turns token auth on; every process of the cluster, the driver included, must say so.
ENV = {**os.environ, "RAY_AUTH_MODE": "token"}


def _ray(*args: str) -> None:
    subprocess.run([RAY, *args], check=True, capture_output=True, timeout=180, env=ENV)


@pytest.fixture(scope="module")
def cluster():
    address = f"127.0.0.1:{free_port()}"
    _ray("start", "--head", f"--port={address.split(':')[1]}", "--num-cpus=0", '--resources={"coordinator_node": 1}',
         "--include-dashboard=false", "--disable-usage-stats")
    try:
        for resource in ("verifier_node", "drafter_node"):
            _ray("start", f"--address={address}", "--num-cpus=1", f'--resources={{"{resource}": 1}}', "--disable-usage-stats")
        yield address
    finally:
        _ray("stop", "--force")


@pytest.mark.e2e
def test_each_replica_runs_on_the_node_of_its_resource_over_mutual_tls(cluster, tiny_dirs, tiny_verifier, tmp_path):
    port = free_port()
    config = tiny_config(tiny_dirs, port=port, service_tls=service_tls(make_certificates(tmp_path)))
    for section, deployment in (("verifier", "Verifier"), ("drafter", "Drafter"), ("coordinator", "Coordinator")):
        config[section]["ray_actor_options"] = {"num_cpus": 0, "resources": {PLACEMENT[deployment]: 0.01}}
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cluster_probe.py")), cluster, json.dumps(config), str(port)],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=Path(__file__).parent.parent,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    [line] = [line for line in probe.stdout.splitlines() if line.startswith("PROBE ")]
    found = json.loads(line.removeprefix("PROBE "))
    assert found["placement"] == {deployment: {resource: 1.0} for deployment, resource in PLACEMENT.items()}, found["placement"]
    assert found["token_ids"] == hf_greedy(tiny_verifier, [1, 4, 5], 24)
    assert found["speculative_rounds"] > 0 and found["draft_wire_ms"] > 0 and found["verify_wire_ms"] > 0
    assert found["own_calls"] == {"Verifier": {"sessions": 0.0}, "Drafter": {"sessions": 0.0}}
