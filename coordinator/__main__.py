"""`python -m coordinator`: the client API as a plain gRPC server over running drafter and
verifier servers (no Ray)."""
from __future__ import annotations

import argparse
import logging

from coordinator.server import start
from specdec.serving.config import ConfigError, load_config
from specdec.app import in_process_services
from specdec.serving.rpc import serve_until_terminated


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description="Run the coordinator as a plain gRPC server.")
    parser.add_argument("--config", help="YAML config (the coordinator section, and the verifier model for its tokenizer)")
    parser.add_argument("--drafter", help="drafter address host:port (else coordinator.drafter_address)")
    parser.add_argument("--verifier", help="verifier address host:port (else coordinator.verifier_address)")
    parser.add_argument("--port", type=int, help="client API port (else coordinator.port)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as err:
        parser.error(str(err))
    drafter = args.drafter or config.coordinator.drafter_address
    verifier = args.verifier or config.coordinator.verifier_address
    if not (verifier or config.coordinator.verifier_in_process) or not (drafter or config.coordinator.drafter_in_process):
        parser.error("give the drafter and verifier addresses (--drafter/--verifier or coordinator.*_address)")
    if args.port is not None:
        config.coordinator.port = args.port
    server, port, _ = start(config, drafter, verifier, local=in_process_services(config))
    print(f"coordinator serving specdec.v1.Coordinator on {config.coordinator.host}:{port}", flush=True)
    serve_until_terminated(server)


main()
