"""The composition root: the one package that knows all three services. The Ray Serve
application (drafter, verifier and coordinator as three deployments) is built here, and
`specdec.app.launch` starts it on a local Ray.

`serve run deploy/serve.yaml` and `specdec serve` both build it here. Application args are
either {"config_file": path} or the config mapping itself (or both: the mapping overrides
the file), in the schema of specdec.serving.config.
"""
from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from specdec.serving.config import Config, config_from_dict, config_to_dict, load_config

if TYPE_CHECKING:
    from ray.serve import Application


def build_config(args: dict | None) -> Config:
    args = dict(args or {})
    base = load_config(args.pop("config_file", None))
    return config_from_dict(args, base=base)


def with_service_token(config: Config) -> Config:
    """The app's services take calls only from its coordinator: a random shared token, unless
    the config names one (all three deployments get the same config)."""
    if not config.coordinator.auth.service_token:
        config.coordinator.auth.service_token = secrets.token_urlsafe(32)
    return config


def build_app(args: dict | None = None) -> Application:
    # Imported here: the plain gRPC servers (`python -m coordinator`) use this package without Ray.
    from coordinator.deployment import CoordinatorDeployment
    from drafter_service.deployment import DrafterDeployment
    from verifier_service.deployment import VerifierDeployment

    config = with_service_token(build_config(args))
    as_dict = config_to_dict(config)
    here = config.coordinator
    drafter = None if here.drafter_in_process else DrafterDeployment.options(**_scaling(config.drafter)).bind(as_dict)
    verifier = None if here.verifier_in_process else VerifierDeployment.options(**_scaling(config.verifier)).bind(as_dict)
    # A coordinator that runs the verifier goes where the verifier would, as many times.
    placement = config.verifier if here.verifier_in_process else here
    return CoordinatorDeployment.options(**_scaling(placement)).bind(as_dict, drafter, verifier, in_process_services)


def in_process_services(config) -> dict:
    """The services the config runs inside the coordinator's process, built there:
    {"drafter" or "verifier": an in-process client} (coordinator.drafter_in_process,
    coordinator.verifier_in_process)."""
    from drafter_service.server import in_process as drafter_here
    from verifier_service.server import in_process as verifier_here

    local = {}
    if config.coordinator.drafter_in_process:
        local["drafter"] = drafter_here(config.drafter, config.limits)
    if config.coordinator.verifier_in_process:
        args = config.service_args("verifier")
        del args["service_token"], args["tls"]  # no call crosses a network to it
        local["verifier"] = verifier_here(config.verifier, **args)
    return local


def _scaling(service) -> dict:
    """Where a model service's replicas run, and how many (fixed or autoscaled); what the
    config leaves at its default is left to Serve, so a Serve config's `deployments:` section
    may set it (and change it in place, where a change of `args` restarts the application)."""
    options = {"ray_actor_options": service.ray_actor_options}
    if service.autoscaling:
        options["autoscaling_config"] = service.autoscaling
    elif service.num_replicas != 1:
        options["num_replicas"] = service.num_replicas
    return options
