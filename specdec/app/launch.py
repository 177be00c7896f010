"""Bringing the Ray Serve application up on this machine (or a running Ray cluster)."""
from __future__ import annotations

import logging
import os

from specdec.serving.rpc import wait_until_serving

log = logging.getLogger(__name__)

APP_NAME = "specdec"
HTTP_PORT = 8000  # Serve's HTTP proxy: the OpenAI-compatible API
GRPC_PROXY_PORT = 9000  # Serve's gRPC proxy: the Coordinator API again, routed by Serve
COORDINATOR_SERVICER = "specdec.v1.coordinator_pb2_grpc.add_CoordinatorServicer_to_server"
_STARTED_HERE: set[str] = set()  # the Ray instances this process started (their GCS addresses)
# A local Ray wakes less often than by its defaults: on a machine whose cores all run the kernels'
# threads, each wake-up of Ray's own processes preempts one thread and the other waits at the end
# of its loop. Serve's controller loop and its replicas' metrics export (every 100 ms by default),
# the raylet's resource reports and GC checks (100 ms) and task-event reports (1 s) come less often;
# on 2 cores an idle stack then slowed a drafter's and a verifier's passes by 1.10x and 1.09x
# instead of 1.20x and 1.12x (docs/engine.md, Sharing the cores). What the environment sets wins.
QUIET_RAY = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000",
    "RAY_raylet_report_resources_period_milliseconds": "1000",
    "RAY_raylet_check_gc_period_milliseconds": "1000",
    "RAY_task_events_report_interval_ms": "5000",
}


def start_stack(
    app_args: dict, port: int, ray_address: str | None = None, timeout_s: float = 900.0,
    http_port: int = HTTP_PORT, grpc_proxy_port: int = GRPC_PROXY_PORT, proxies: bool = True,
) -> str:
    """Deploys drafter, verifier and coordinator with Ray Serve and waits until the client API
    reports SERVING; returns its address. Serve's proxies listen on http_port (the OpenAI API)
    and grpc_proxy_port (the Coordinator API through Serve); `proxies=False` starts none (the
    benchmarks talk to the coordinator's own port and leave 8000 and 9000 free)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address)
        else:
            start_local_ray()
    from specdec.app import build_config

    config = build_config(app_args)
    if ray_address and not config.coordinator.service_tls.enabled:
        from specdec.serving.certificates import make_certificates

        # Inline, as the service token is: replicas on other machines share no files with this one.
        coordinator = {**app_args.get("coordinator", {}), "service_tls": make_certificates().service_tls()}
        app_args = {**app_args, "coordinator": coordinator}
        log.info("links inside on mutual TLS with certificates made for this app (coordinator.service_tls sets your own)")
    tls = config.coordinator.tls  # the HTTP API gets the gRPC API's certificate
    https = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file} if tls.enabled else {}
    serve.start(
        proxy_location="HeadOnly" if proxies else "Disabled",
        http_options={"host": "0.0.0.0", "port": http_port, **https},
        grpc_options={"port": grpc_proxy_port, "grpc_servicer_functions": [COORDINATOR_SERVICER], "enable_reflection": True},
    )
    return deploy(app_args, port, timeout_s, on_cluster=ray_address is not None)


def deploy(app_args: dict, port: int, timeout_s: float = 900.0, name: str = APP_NAME, on_cluster: bool = False) -> str:
    """(Re)deploys the application `name` on the running Serve instance; returns its client
    address once it reports SERVING: localhost:port, or `on_cluster` the address of the node a
    coordinator replica runs on, which clients on other nodes can reach. A redeploy with other
    settings must use another port: the old coordinator may still hold its own while the new
    one starts. Applications of other names run side by side (the benchmark compares drafters
    that way); their HTTP routes start with /<name>."""
    from ray import serve

    from specdec.app import build_app, build_config

    coordinator = build_config(app_args).coordinator
    if not on_cluster and port != coordinator.port:  # else the wait below watches a port nobody opens
        raise ValueError(f"the app's coordinator.port is {coordinator.port}, not {port}: set it in the app args (or its config file)")
    tls = coordinator.tls
    route = "/" if name == APP_NAME else f"/{name}"
    serve.run(build_app(app_args), name=name, route_prefix=route, blocking=False)
    if on_cluster:  # Serve answers once the coordinator replica is up (the model replicas first)
        address = serve.get_deployment_handle("Coordinator", app_name=name).address.remote().result(timeout_s=timeout_s)
    else:
        address = f"localhost:{port}"
    wait_until_serving(address, timeout_s, root_certificates=tls.trusted() if tls.enabled else None)
    return address


def start_beside(app_args: dict, port: int, index: int) -> str:
    """The index-th of several stacks side by side on one Serve instance, as the benchmarks
    compare them: the first starts Ray and Serve (no proxies), the others deploy beside it
    under names of their own. Returns its client address."""
    if index == 0:
        return start_stack(app_args, port, proxies=False)
    return deploy(app_args, port, name=beside_name(index))


def beside_name(index: int) -> str:
    """The Serve application name of the index-th stack side by side (start_beside)."""
    return f"{APP_NAME}-{index}" if index else APP_NAME


def start_local_ray(attempts: int = 3) -> None:
    """A local Ray head on this machine's cores. On a loaded 2-core machine, right after another
    Ray instance stopped, its GCS or raylet can miss one of Ray's fixed start-up deadlines (seen
    in test runs, twice in three); another try after a pause succeeds."""
    import time

    import ray

    for name, value in QUIET_RAY.items():  # Ray's processes read them from the environment they start in
        os.environ.setdefault(name, value)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
            _STARTED_HERE.add(ray.get_runtime_context().gcs_address)
            return
        except Exception as err:  # Ray raises a bare Exception or a RuntimeError for these
            if "timed out" not in str(err).lower() or attempt == attempts:
                raise
            log.warning("Ray did not start in time (try %d of %d): %s", attempt, attempts, err)
            ray.shutdown()
            time.sleep(5)


def stop_stack() -> None:
    """Deletes this process's Serve applications (their replicas stop as Serve stops them), then
    leaves Ray: a local instance ends with this process; a cluster joined keeps serving others.
    Serve's own shutdown is left out: it kills its controller mid-call, and Ray prints that as
    a failed task."""
    import ray
    from ray import serve

    if not ray.is_initialized():  # stopped before Ray started: nothing to stop
        return
    node = ray.get_runtime_context().gcs_address
    for name in serve.status().applications if node in _STARTED_HERE else [APP_NAME]:
        serve.delete(name)
    ray.shutdown()
