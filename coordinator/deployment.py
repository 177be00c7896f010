"""The coordinator as a Ray Serve deployment. It asks the drafter and verifier deployments
where their gRPC servers listen, then serves the client API on the configured port. It is
also the application's ingress: the OpenAI-compatible HTTP API through Serve's HTTP proxy,
and the same gRPC API through Serve's gRPC proxy (methods named as the RPCs)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ray import serve
from ray.serve.handle import DeploymentHandle

from coordinator.metrics import RequestMetrics
from coordinator.openai_api import ForwardedCall, OpenAIFrontend, openai_app
from coordinator.server import CoordinatorServicer, start
from specdec.serving.config import config_from_dict
from specdec.serving.replica import GrpcReplica
from specdec.serving.rpc import ServiceError
from specdec.v1 import coordinator_pb2

RESOLVE_TIMEOUT_S = 2.0


@serve.deployment(name="Coordinator", num_replicas=1)
@serve.ingress()
class CoordinatorDeployment(GrpcReplica):
    def __init__(self, config: dict, drafter: DeploymentHandle | None, verifier: DeploymentHandle):
        """drafter is None when it runs inside the coordinator (coordinator.drafter_in_process)."""
        parsed = config_from_dict(config)
        # The constructor runs on the replica's event loop, where blocking handle calls are
        # refused; ask from a worker thread instead.
        with ThreadPoolExecutor(max_workers=2) as pool:
            drafter_address, verifier_address = pool.map(lambda h: h and h.address.remote().result(), (drafter, verifier))
        handles = {"drafter": drafter, "verifier": verifier}

        def resolve(name: str) -> str:
            """Where the service's replica listens now: a restarted one binds a new port."""
            return handles[name].address.remote().result(timeout_s=RESOLVE_TIMEOUT_S)

        server, port, coordinator = start(parsed, drafter_address, verifier_address, RequestMetrics().record, resolve)
        self._serving(server, port)
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
