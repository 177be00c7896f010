"""The verifier as a Ray Serve deployment serving the Verifier gRPC API on its own port."""
from __future__ import annotations

from ray import serve

from specdec.serving.config import config_from_dict
from specdec.serving.replica import ModelReplica
from specdec.serving.wire import VERIFIER_SERVICE
from verifier_service.server import start


@serve.deployment(name="Verifier")
class VerifierDeployment(ModelReplica):
    def __init__(self, config: dict):
        parsed = config_from_dict(config)
        self._serving(*start(parsed.verifier, **parsed.service_args("verifier")))
        self._join(VERIFIER_SERVICE, tls=parsed.coordinator.service_tls)
