from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import settings

from specdec.serving.config import config_from_dict
from specdec.serving.rpc import free_port  # noqa: F401 - the tests import it from here
from tests.tiny_models import build_model_dir, build_perturbed_copy

# Hypothesis draws new examples every run ("dev", the default); HYPOTHESIS_PROFILE=ci draws the
# same ones every run, for a CI that fails only on a change. Either prints the blob that
# replays a failing example (@reproduce_failure).
settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Ray starts its worker processes at nice 15: beside a busy process (another test run, a build)
# the Serve tests' replicas got a sliver of the CPU and took minutes to start (past the tests'
# 300 s wait). At the tests' own priority they start as fast as the machine allows.
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {
        "verifier": build_model_dir(root / "verifier", seed=1),
        "drafter": build_model_dir(root / "drafter", seed=2, layers=1),
        # A drafter that agrees with the verifier more often: the verifier's own first layer.
        "other_words": build_model_dir(root / "other_words", seed=3, words=[f"x{i}" for i in range(16)]),
    }
    # A drafter close to the verifier that is not the verifier: guesses come true often, and
    # rejection sampling still has q != p to correct.
    dirs["near_verifier"] = build_perturbed_copy(dirs["verifier"], root / "near_verifier", seed=4)
    return dirs


@pytest.fixture(scope="session")
def tiny_verifier(tiny_dirs):
    from specdec.core.models import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_dirs["verifier"])))


@contextlib.contextmanager
def local_stack(config_dict: dict):
    """Drafter, verifier and coordinator as plain gRPC servers in this process (a service the
    config runs inside the coordinator gets no server of its own)."""
    import coordinator.server
    import drafter_service.server
    import verifier_service.server
    from specdec.app import in_process_services

    config = config_from_dict(config_dict)
    config.coordinator.port = 0
    local = in_process_services(config)
    servers, addresses = [], {}
    for name, service in (("verifier", verifier_service.server), ("drafter", drafter_service.server)):
        if name not in local:
            server, port = service.start(getattr(config, name), **config.service_args(name))
            servers.append(server)
            addresses[name] = f"localhost:{port}"
    c_server, c_port, coord = coordinator.server.start(config, addresses.get("drafter"), addresses.get("verifier"), local=local)
    try:
        yield {"coordinator": f"localhost:{c_port}", **addresses, "coordinator_obj": coord}
    finally:
        for server in (c_server, *servers):
            server.stop(grace=None)
        coord.pair.close()


@contextlib.contextmanager
def plain_services(config):
    """The config's verifier and drafter as plain gRPC servers in this process: (drafter
    address, verifier address); no coordinator, so a test can make the pair itself."""
    import drafter_service.server
    import verifier_service.server

    v_server, v_port = verifier_service.server.start(config.verifier, **config.service_args("verifier"))
    d_server, d_port = drafter_service.server.start(config.drafter, **config.service_args("drafter"))
    try:
        yield f"localhost:{d_port}", f"localhost:{v_port}"
    finally:
        v_server.stop(None)
        d_server.stop(None)


def service_pair(drafter: str, verifier: str):
    """The coordinator's view of one drafter and one verifier at these addresses."""
    from coordinator.clients import Replicas, ServicePair
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE

    return ServicePair(*(Replicas.of(name, MeasuredClient(address, service)) for name, address, service in (
        ("drafter", drafter, DRAFTER_SERVICE), ("verifier", verifier, VERIFIER_SERVICE))))


def service_info(address: str, service: str):
    """The service's own Info: its model and load, and counters since it started."""
    from specdec.serving.rpc import MeasuredClient
    from specdec.v1 import common_pb2

    client = MeasuredClient(address, service)
    try:
        return client.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo)[0]
    finally:
        client.close()


class VerifyGate:
    """Holds the verifier's Verify calls that `hold(request)` picks at the door of its handler
    (gRPC counts them as calls in flight) until open(): a known way to keep a request, or a
    service's call slots, busy without betting on how long anything takes. It patches the
    servicer class, so make it before the verifier starts; `with gate:` opens it on the way
    out, so no handler thread is left waiting."""

    def __init__(self, monkeypatch, hold):
        import threading

        from verifier_service.server import VerifierServicer

        self._opened = threading.Event()
        self._changed = threading.Condition()
        self.held = 0  # calls that waited at the door so far
        real = VerifierServicer.Verify

        def verify(servicer, request, context):
            if not self._opened.is_set() and hold(request):
                with self._changed:
                    self.held += 1
                    self._changed.notify_all()
                self._opened.wait()
            return real(servicer, request, context)

        monkeypatch.setattr(VerifierServicer, "Verify", verify)

    def wait_held(self, calls: int, timeout_s: float = 60.0) -> bool:
        """Whether `calls` calls are held (or were); the timeout only guards against a hang."""
        with self._changed:
            return self._changed.wait_for(lambda: self.held >= calls, timeout_s)

    def open(self) -> None:
        self._opened.set()

    def __enter__(self) -> "VerifyGate":
        return self

    def __exit__(self, *exc) -> None:
        self.open()


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
