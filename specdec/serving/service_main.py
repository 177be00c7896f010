"""`python -m drafter_service` / `python -m verifier_service`: one service as a plain gRPC
server, without Ray (for tests, and for Kubernetes without Ray)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Callable

from specdec.core.models import ModelSpec
from specdec.serving.config import ConfigError, load_config
from specdec.serving.rpc import serve_until_terminated


def run_service(name: str, start: Callable) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {name}_service", description=f"Run the {name} as a plain gRPC server.")
    parser.add_argument("--config", help="YAML config; its `%s` section is used" % name)
    parser.add_argument("--model", help="model name, directory, .gguf file or built-in alias")
    parser.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    parser.add_argument("--host", help="interface to bind")
    parser.add_argument("--port", type=int, help="port to listen on")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = load_config(args.config)
        section = getattr(config, name)
    except ConfigError as err:
        parser.error(str(err))
    if args.model:
        section.model = ModelSpec(args.model, layers=args.layers, dtype=section.model.dtype, device=section.model.device)
    elif args.layers:
        section.model = dataclasses.replace(section.model, layers=args.layers)
    section.host = args.host or section.host
    section.port = args.port if args.port is not None else section.port
    server, port = start(section, **config.service_args(name))
    print(f"{name} serving {section.model.source} on {section.host}:{port}", flush=True)
    serve_until_terminated(server)
