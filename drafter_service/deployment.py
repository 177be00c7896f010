"""The drafter as a Ray Serve deployment: a replica that serves the Drafter gRPC API on its
own port, so the per-round data plane is direct gRPC rather than Serve handles."""
from __future__ import annotations

import ray
from ray import serve

from drafter_service.server import start
from specdec.config import config_from_dict


@serve.deployment(name="Drafter", num_replicas=1)
class DrafterDeployment:
    def __init__(self, config: dict):
        self.server, self.port = start(config_from_dict(config).drafter)
        self.host = ray.util.get_node_ip_address()

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __del__(self):
        if hasattr(self, "server"):
            self.server.stop(grace=1)
