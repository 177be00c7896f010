"""What the three Ray Serve deployments share: a replica that serves its own gRPC API on its
own port, so the per-round data plane is direct gRPC rather than Serve handles."""
from __future__ import annotations

import grpc
import ray

from specdec.serving.rpc import stop_gracefully


class GrpcReplica:
    def _serving(self, server: grpc.Server, port: int) -> None:
        self.server, self.port = server, port
        self.host = ray.util.get_node_ip_address()

    def address(self) -> str:
        """host:port of this replica's gRPC server."""
        return f"{self.host}:{self.port}"

    def __del__(self):
        if hasattr(self, "server"):
            stop_gracefully(self.server)
