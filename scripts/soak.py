"""Load and soak test: many concurrent streams against the served stack for minutes, mixed
greedy, sampled, cancelled and bad requests. It checks that nothing unexpected fails, that
every greedy output equals the verifier alone's, that no session is left behind, and how
much memory each service holds at the start and the end.

    .venv/bin/python scripts/soak.py --minutes 10 --concurrency 32 --out docs/benchmarks/soak.json

Without --address it starts the stack itself (as `specdec serve` does: the default config, or
--config's).
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from specdec.bench.cluster import LocalCluster
from specdec.core.prompts import PACKAGED_PROMPTS, evaluation_split, load_prompts
from specdec.serving.client import CoordinatorClient, generate_request

BAD_REQUESTS = [
    generate_request(""),
    generate_request("Hi", temperature=-1.0),
    generate_request("Hi", max_new_tokens=0),
    generate_request("Hi", top_p=1.5),
    generate_request("Hi", num_draft_tokens=10**6),
    generate_request("Hi", stop=[""]),
    generate_request(prompt_token_ids=[10**9]),
]


def service_state(app: str = "specdec") -> dict:
    """What each model service holds now: sessions, their KV cache and the process's memory."""
    from ray import serve

    state = {}
    for name in ("Drafter", "Verifier"):
        info = serve.get_deployment_handle(name, app_name=app).info.remote().result()  # over the replica's own link
        state[name.lower()] = {
            "sessions": info.active_sessions, "kv_cache_mib": round(info.kv_cache_mib, 1), "resident_mib": round(info.resident_mib, 1)
        }
    return state


class Soak:
    def __init__(self, address: str, prompts: list[str], max_new_tokens: int, seconds: float):
        self.address, self.prompts, self.max_new_tokens = address, prompts, max_new_tokens
        self.until = time.monotonic() + seconds
        self.outcomes: Counter = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.references = {}

    def prepare(self) -> None:
        """The verifier alone's greedy answer to every prompt: what speculation must equal."""
        client = CoordinatorClient(self.address)
        for prompt in self.prompts:
            reply = client.generate(
                generate_request(prompt, use_chat_template=True, max_new_tokens=self.max_new_tokens, num_draft_tokens=0)
            )
            self.references[prompt] = list(reply.token_ids)
        client.close()

    def worker(self, seed: int) -> None:
        rng, client, kind = random.Random(seed), CoordinatorClient(self.address), None
        while time.monotonic() < self.until:
            cancelled, kind = kind == "cancelled", rng.choices(["greedy", "sampled", "cancelled", "bad"], weights=[5, 3, 1, 1])[0]
            try:
                self._one(client, rng, kind)
            except grpc.RpcError as err:
                # With every worker busy, the slot of the stream this one just cancelled is free
                # only once the coordinator hears of the cancel: a refusal then is the limit's.
                if cancelled and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._count("refused right after its own cancel")
                    time.sleep(0.05)
                    continue
                self._record(f"{kind}: {err.code().name}: {err.details()}")
        client.close()

    def _one(self, client: CoordinatorClient, rng: random.Random, kind: str) -> None:
        prompt = rng.choice(self.prompts)
        if kind == "bad":
            try:
                client.generate(rng.choice(BAD_REQUESTS), timeout=60)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                self._count("bad refused")
                return
            self._record("bad request was served")
            return
        fields = dict(use_chat_template=True, max_new_tokens=self.max_new_tokens)
        if kind == "greedy":
            tokens = [t for part in client.stream(generate_request(prompt, **fields), timeout=600) for t in part.token_ids]
            if tokens != self.references[prompt]:
                self._record(f"greedy output differs from the verifier alone's for {prompt[:40]!r}")
                return
        elif kind == "sampled":
            reply = client.generate(generate_request(prompt, temperature=0.8, top_p=0.95, seed=rng.randrange(2**32), **fields), timeout=600)
            if not reply.finish_reason:
                self._record("a sampled answer has no finish_reason")
                return
        else:
            stream = client.stream(generate_request(prompt, **fields), timeout=600)
            next(stream)
            stream.cancel()
        self._count(kind)

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def _record(self, problem: str) -> None:
        with self.lock:
            self.unexpected.append(problem)
            if len(self.unexpected) <= 5:
                print(f"unexpected: {problem}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", help="a running coordinator (its Ray cluster must be reachable); default: start the stack here")
    parser.add_argument("--cluster", action="store_true", help="start it on a multi-node Ray cluster on this machine "
                        "(specdec/bench/cluster.py: a worker node each for the verifier and the drafter)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompts", default=str(PACKAGED_PROMPTS), help="as specdec bench's: a JSONL file, humaneval or code-edit")
    parser.add_argument("--config", help="the YAML config the stack serves (default: the built-in one); not with --address")
    parser.add_argument("--out", default="docs/benchmarks/soak.json")
    args = parser.parse_args()

    app_args = {"config_file": args.config} if args.config else {}
    if args.config and args.address:
        parser.error("--config configures the stack the soak starts; a running one (--address) has its own")
    if args.cluster:
        with LocalCluster({"coordinator_node": 1}) as cluster:  # entered before Ray is imported
            cluster.start_service_nodes()
            ok = run_soak(args, cluster.deploy(app_args, 50051))
    else:
        import ray

        from specdec.app.launch import start_stack, stop_stack

        if args.address is None:
            try:
                ok = run_soak(args, start_stack(app_args, 50051))
            finally:
                stop_stack()
        else:
            if not ray.is_initialized():
                ray.init(address="auto")
            ok = run_soak(args, args.address)
    raise SystemExit(0 if ok else 1)


def run_soak(args, address: str) -> bool:
    """Runs the soak against the coordinator at `address` and writes its report; whether it
    ended with no unexpected error and no session left."""
    prompts = [row["prompt"] for row in evaluation_split(load_prompts(args.prompts), args.num_prompts)]
    soak = Soak(address, prompts, args.max_new_tokens, args.minutes * 60)
    soak.prepare()
    before = service_state()
    print(f"start: {before}", flush=True)
    started = time.monotonic()
    soak.until = started + args.minutes * 60
    threads = [threading.Thread(target=soak.worker, args=(i,)) for i in range(args.concurrency)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        time.sleep(min(30.0, max(1.0, soak.until - time.monotonic())))
        print(f"{(time.monotonic() - started) / 60:.1f} min: {dict(soak.outcomes)}, unexpected {len(soak.unexpected)}", flush=True)
    after, settled = service_state(), time.monotonic() + 30  # EndSession calls are fire and forget
    while any(s["sessions"] for s in after.values()) and time.monotonic() < settled:
        time.sleep(1)
        after = service_state()
    report = {
        "command": "python scripts/soak.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
            for k, v in vars(args).items() if v not in (None, False) and k != "address"
        ),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "outcomes": dict(soak.outcomes),
        "requests": sum(soak.outcomes.values()) + len(soak.unexpected),
        "unexpected": soak.unexpected[:50],
        "unexpected_count": len(soak.unexpected),
        "services_start": before,
        "services_end": after,
        "sessions_left": sum(s["sessions"] for s in after.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return not soak.unexpected and report["sessions_left"] == 0


if __name__ == "__main__":
    main()
