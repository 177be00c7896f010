"""Bringing the Ray Serve application up on this machine (or a running Ray cluster)."""
from __future__ import annotations

import logging
import os

from specdec.serving.rpc import wait_until_serving

log = logging.getLogger(__name__)

APP_NAME = "specdec"


def start_stack(app_args: dict, port: int, ray_address: str | None = None, timeout_s: float = 900.0) -> str:
    """Deploys drafter, verifier and coordinator with Ray Serve and waits until the client API
    reports SERVING; returns its address."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address)
        else:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    return deploy(app_args, port, timeout_s)


def deploy(app_args: dict, port: int, timeout_s: float = 900.0, name: str = APP_NAME) -> str:
    """(Re)deploys the application `name` on the running Serve instance; returns its client
    address once it reports SERVING. A redeploy with other settings must use another port: the
    old coordinator may still hold its own while the new one starts. Applications of other
    names run side by side (the benchmark compares drafters that way)."""
    from ray import serve

    from specdec.serving.app import build_app

    serve.run(build_app(app_args), name=name, route_prefix=None, blocking=False)
    address = f"localhost:{port}"
    wait_until_serving(address, timeout_s)
    return address


def stop_stack() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
