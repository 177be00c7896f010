"""The verifier as a Ray Serve deployment: a replica that serves the Verifier gRPC API on its
own port, so the per-round data plane is direct gRPC rather than Serve handles."""
from __future__ import annotations

import ray
from ray import serve

from specdec.config import config_from_dict
from verifier_service.server import start


@serve.deployment(name="Verifier", num_replicas=1)
class VerifierDeployment:
    def __init__(self, config: dict):
        self.server, self.port = start(config_from_dict(config).verifier)
        self.host = ray.util.get_node_ip_address()

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __del__(self):
        if hasattr(self, "server"):
            self.server.stop(grace=1)
