"""The coordinator as a Ray Serve deployment. It asks the drafter and verifier deployments
where their gRPC servers listen, then serves the client API on the configured port."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ray import serve
from ray.serve.handle import DeploymentHandle

from coordinator.metrics import RequestMetrics
from coordinator.server import start
from specdec.serving.config import config_from_dict
from specdec.serving.replica import GrpcReplica


@serve.deployment(name="Coordinator", num_replicas=1)
class CoordinatorDeployment(GrpcReplica):
    def __init__(self, config: dict, drafter: DeploymentHandle | None, verifier: DeploymentHandle):
        """drafter is None when it runs inside the coordinator (coordinator.drafter_in_process)."""
        parsed = config_from_dict(config)
        # The constructor runs on the replica's event loop, where blocking handle calls are
        # refused; ask from a worker thread instead.
        with ThreadPoolExecutor(max_workers=2) as pool:
            drafter_address, verifier_address = pool.map(lambda h: h and h.address.remote().result(), (drafter, verifier))
        server, port, self.coordinator = start(parsed, drafter_address, verifier_address, RequestMetrics().record)
        self._serving(server, port)
