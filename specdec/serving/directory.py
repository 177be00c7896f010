"""Where the replicas of each model service listen: one small named Ray actor per application.

The per-round data plane is direct gRPC, so the coordinator must know every replica's address,
which Serve's handles (they route each call to one replica of their choosing) do not tell.
Model replicas announce themselves every few seconds and leave when Serve stops them; one that
died without leaving drops out once its announcements stop.
"""
from __future__ import annotations

import time

import ray

HEAD_NODE = "node:__internal_head__"  # a resource only Ray's head node has
EXPIRES_S = 15.0  # three missed announcements (specdec/serving/replica.py announces every 5 s)


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    def __init__(self):
        self._replicas: dict[str, dict[str, tuple[str, float]]] = {}  # service -> replica id -> (address, last seen)

    def announce(self, service: str, replica_id: str, address: str) -> None:
        self._replicas.setdefault(service, {})[replica_id] = (address, time.monotonic())

    def leave(self, service: str, replica_id: str) -> None:
        self._replicas.get(service, {}).pop(replica_id, None)

    def members(self, service: str) -> dict[str, str]:
        """replica id -> address of the service's replicas heard from lately."""
        now, members = time.monotonic(), self._replicas.get(service, {})
        for replica_id in [r for r, (_, seen) in members.items() if now - seen > EXPIRES_S]:
            del members[replica_id]
        return {replica_id: address for replica_id, (address, _) in members.items()}


def replica_directory(app_name: str):
    """The application's directory, created by whichever replica asks first. Detached, so it
    outlives the replica that created it when Serve scales that one away; on the head node, as
    Serve's controller is, so that it outlives the loss of any worker node."""
    return ReplicaDirectory.options(
        name=f"specdec-replicas-{app_name}", namespace="specdec", lifetime="detached", get_if_exists=True,
        resources={HEAD_NODE: 0.001},
    ).remote()
