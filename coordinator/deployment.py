"""The coordinator as a Ray Serve deployment. It learns where the drafter's and verifier's
replicas serve gRPC from the application's replica directory (and keeps learning as Serve
scales them), then serves the client API on the configured port; several coordinator replicas
on one node share that port (SO_REUSEPORT). It is also the application's ingress: the
OpenAI-compatible HTTP API through Serve's HTTP proxy, and the same gRPC API through Serve's
gRPC proxy (methods named as the RPCs)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from coordinator.metrics import RequestMetrics
from coordinator.openai_api import ForwardedCall, OpenAIFrontend, openai_app
from coordinator.server import CoordinatorServicer, start
from specdec.serving.config import config_from_dict
from specdec.serving.directory import replica_directory
from specdec.serving.replica import ModelReplica
from specdec.serving.rpc import ServiceError
from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE
from specdec.v1 import coordinator_pb2

DISCOVER_TIMEOUT_S = 2.0
ANNOUNCE_WAIT_S = 60.0  # a model replica announces itself right after it starts serving


@serve.deployment(name="Coordinator")
@serve.ingress()
class CoordinatorDeployment(ModelReplica):
    def __init__(self, config: dict, drafter: DeploymentHandle | None, verifier: DeploymentHandle | None, in_process_services):
        """A service's handle is None when it runs inside the coordinator (coordinator.drafter_in_process,
        coordinator.verifier_in_process); in_process_services(config) builds those here."""
        parsed = config_from_dict(config)
        directory = replica_directory(serve.get_replica_context().app_name)
        services = {"drafter": DRAFTER_SERVICE, "verifier": VERIFIER_SERVICE}

        def discover(name: str) -> dict[str, str]:
            """The service's replicas now: Serve scales them, and a restarted one binds a new port."""
            return ray.get(directory.members.remote(services[name]), timeout=DISCOVER_TIMEOUT_S)

        local = {}

        def connect():
            for name, handle in (("drafter", drafter), ("verifier", verifier)):
                if handle is not None:
                    handle.address.remote().result()  # Serve answers once a replica is up
                    _until(lambda: discover(name), ANNOUNCE_WAIT_S, f"no {name} replica announced itself")
            local.update(in_process_services(parsed))
            return start(parsed, None, None, RequestMetrics().record, discover, local)

        # The constructor runs on the replica's event loop, where blocking calls are refused.
        with ThreadPoolExecutor(max_workers=1) as pool:
            server, port, coordinator = pool.submit(connect).result()
        self._serving(server, port)
        if "verifier" in local:  # its sessions and memory as a verifier replica's: gauges, autoscaling
            self._join(VERIFIER_SERVICE, in_process=local["verifier"])
        self.servicer = CoordinatorServicer(coordinator)
        self.tokens = parsed.coordinator.auth.accepted()
        self.frontend = OpenAIFrontend(self.servicer, parsed.verifier.model.source, self.tokens)

    def __serve_build_asgi_app__(self):
        return openai_app(self.frontend)

    # Serve's gRPC proxy calls these by the RPC's name (sync methods run on Serve's thread pool).
    # A refused call returns with its status set on Serve's context, as Serve expects (a raised
    # exception would reach the client as INTERNAL with a traceback).
    def Generate(self, request, grpc_context):
        try:
            return self.servicer.Generate(request, self._forwarded(grpc_context))
        except ServiceError:
            return coordinator_pb2.GenerateResponse()

    def GenerateStream(self, request, grpc_context):
        try:
            yield from self.servicer.GenerateStream(request, self._forwarded(grpc_context))
        except ServiceError:
            return

    def _forwarded(self, grpc_context) -> ForwardedCall:
        call = ForwardedCall(list(grpc_context.invocation_metadata()), grpc_context)
        call.authorize(self.tokens)
        return call


def _until(attempt, seconds: float, failure: str):
    deadline = time.monotonic() + seconds
    while not (result := attempt()):
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.2)
    return result
