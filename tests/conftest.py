from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from specdec.serving.config import config_from_dict
from tests.tiny_models import build_model_dir


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "verifier": build_model_dir(root / "verifier", seed=1),
        "drafter": build_model_dir(root / "drafter", seed=2, layers=1),
        # A drafter that agrees with the verifier more often: the verifier's own first layer.
        "other_words": build_model_dir(root / "other_words", seed=3, words=[f"x{i}" for i in range(16)]),
    }


@pytest.fixture(scope="session")
def tiny_verifier(tiny_dirs):
    from specdec.core.models import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_dirs["verifier"])))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_stack(config_dict: dict):
    """Drafter, verifier and coordinator as plain gRPC servers in this process."""
    import coordinator.server
    import drafter_service.server
    import verifier_service.server

    config = config_from_dict(config_dict)
    config.coordinator.port = 0
    v_server, v_port = verifier_service.server.start(config.verifier, **config.service_args("verifier"))
    d_server, d_port = drafter_service.server.start(config.drafter, **config.service_args("drafter"))
    c_server, c_port, coord = coordinator.server.start(config, f"localhost:{d_port}", f"localhost:{v_port}")
    try:
        yield {"coordinator": f"localhost:{c_port}", "drafter": f"localhost:{d_port}", "verifier": f"localhost:{v_port}", "coordinator_obj": coord}
    finally:
        for server in (c_server, d_server, v_server):
            server.stop(grace=None)
        coord.pair.close()


def service_pair(drafter: str, verifier: str):
    """The coordinator's view of one drafter and one verifier at these addresses."""
    from coordinator.clients import Replicas, ServicePair
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE

    return ServicePair(*(Replicas.of(name, MeasuredClient(address, service)) for name, address, service in (
        ("drafter", drafter, DRAFTER_SERVICE), ("verifier", verifier, VERIFIER_SERVICE))))


def tiny_config(tiny_dirs, **coordinator) -> dict:
    """Requests that name no plan run the configured one (the served default is adaptive, which
    would leave these tests' speculation to the controller's choice)."""
    return {
        "verifier": {"model": str(tiny_dirs["verifier"]), "torch_threads": 1},
        "drafter": {"model": str(tiny_dirs["drafter"]), "torch_threads": 1},
        "coordinator": {"num_draft_tokens": 3, "adaptive": {"enabled": False}, **coordinator},
    }


@pytest.fixture(scope="module")
def tiny_stack(tiny_dirs):
    with local_stack(tiny_config(tiny_dirs)) as stack:
        yield stack
