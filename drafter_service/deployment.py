"""The drafter as a Ray Serve deployment serving the Drafter gRPC API on its own port."""
from __future__ import annotations

from ray import serve

from drafter_service.server import start
from specdec.serving.config import config_from_dict
from specdec.serving.replica import ModelReplica
from specdec.serving.wire import DRAFTER_SERVICE


@serve.deployment(name="Drafter")
class DrafterDeployment(ModelReplica):
    def __init__(self, config: dict):
        parsed = config_from_dict(config)
        self._serving(*start(parsed.drafter, **parsed.service_args("drafter")))
        self._join(DRAFTER_SERVICE, tls=parsed.coordinator.service_tls)
