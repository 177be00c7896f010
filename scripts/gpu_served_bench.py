"""The coder pair served on a GPU through the plain gRPC servers (no Ray: the lent GPU machines have
none): Qwen2.5-Coder-1.5B-Instruct verifying in bfloat16 with CUDA graphs, drafted by the suffix
index and, where its file is given, by SmolLM2-135M-Instruct in its own tokens on the same GPU.
One verifier server serves both drafters' coordinators. On each of the bench's held-out prompt sets
the methods run interleaved on every prompt, each output compared token for token with the verifier
alone's; the drafters' memory across requests is off (every method decodes each prompt). Greedy.
JSON and a plot in OUT.

    python scripts/gpu_served_bench.py --out OUT --verifier Q15B.gguf [--smollm2 S135M.gguf] \\
        [--prompts humaneval,humaneval-fresh,code-edit] [--num-prompts 6] [--max-new-tokens 128] [--suffix-plans chain-8,adaptive]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specdec.serving.rpc import free_port

SUFFIX_PLANS = {"chain-4": ("chain", 4), "chain-8": ("chain", 8), "chain-15": ("chain", 15), "adaptive": None}
ALONE = ("chain", 0)
SMOLLM2_PLANS = {"chain-2": ("chain", 2), "chain-4": ("chain", 4), "adaptive": None}


def start(module: str, args: list[str], log: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-u", "-m", module, *args], stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while time.time() < deadline:
        if " serving " in log.read_text():
            return process
        if process.poll() is not None:
            raise RuntimeError(f"{module} exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"{module} did not start:\n{log.read_text()[-3000:]}")


def stack_config(out: Path, name: str, verifier: str, drafter: str, device: str) -> Path:
    path = out / f"{name}.yaml"
    path.write_text(f"""
verifier:
  model: {{source: {verifier}, dtype: bfloat16, device: {device}}}
  prefix_cache_mib: 0
drafter:
{drafter}
""")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--verifier", required=True, help="the 1.5B's GGUF file")
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's GGUF file: a second stack drafting with it")
    parser.add_argument("--prompts", default="humaneval,humaneval-fresh,code-edit")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--suffix-plans", default=",".join(SUFFIX_PLANS), help="which of the suffix drafter's plans run")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix_plans = {name: SUFFIX_PLANS[name] for name in args.suffix_plans.split(",")}
    drafters = {"suffix": ("  model: suffix\n  ngram: {recent_output_tokens: 0}", suffix_plans)}
    if args.smollm2:
        drafters["smollm2"] = (f"  model: {{source: {args.smollm2}, dtype: bfloat16, device: {args.device}}}\n  tokenizer: own",
                               SMOLLM2_PLANS)
    configs = {name: stack_config(out, name, args.verifier, text, args.device) for name, (text, _) in drafters.items()}
    processes = []
    try:
        verifier_port = free_port()
        begin = time.perf_counter()
        verifier_args = ["--config", str(configs["suffix"]), "--port", str(verifier_port)]
        processes.append(start("verifier_service", verifier_args, out / "verifier.log"))
        print(f"verifier up in {time.perf_counter() - begin:.0f} s", flush=True)
        addresses = {}
        for name, config in configs.items():
            drafter_port, coordinator_port = free_port(), free_port()
            processes.append(start("drafter_service", ["--config", str(config), "--port", str(drafter_port)], out / f"drafter_{name}.log"))
            processes.append(start("coordinator", ["--config", str(config), "--drafter", f"localhost:{drafter_port}",
                                                   "--verifier", f"localhost:{verifier_port}", "--port", str(coordinator_port)],
                                   out / f"coordinator_{name}.log"))
            addresses[name] = f"localhost:{coordinator_port}"
        run(args, addresses, {name: plans for name, (_, plans) in drafters.items()}, out / "gpu_served_bench.json")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
    plot(json.loads((out / "gpu_served_bench.json").read_text()), out / "gpu_served_bench.png")


def run(args, addresses: dict[str, str], plans: dict[str, dict], path: Path) -> None:
    """Every prompt set in turn, the results written to `path` after each."""
    from specdec.core.models import load_tokenizer
    from specdec.core.prompts import chat_ids, evaluation_split, load_prompts
    from specdec.serving.client import CoordinatorClient, generate_request
    from specdec.v1.common_pb2 import TreeShape

    tokenizer = load_tokenizer(args.verifier)
    clients = {name: CoordinatorClient(address) for name, address in addresses.items()}
    methods = [("suffix", "verifier alone", ALONE)]
    methods += [(name, plan, shape) for name, named in plans.items() for plan, shape in named.items()]

    def generate(name: str, shape, ids: list[int], max_new_tokens: int):
        if shape is None:
            fields = {"adaptive": True}
        elif shape == ALONE:
            fields = {"num_draft_tokens": 0, "adaptive": False}
        else:
            fields = {"num_draft_tokens": shape[1], "tree": TreeShape(method=shape[0]), "adaptive": False}
        begin = time.perf_counter()
        reply = clients[name].generate(generate_request(prompt_token_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0, **fields))
        return reply, time.perf_counter() - begin

    sets = {}
    for kind in args.prompts.split(","):
        rows = evaluation_split(load_prompts(kind), args.num_prompts + 1)
        ids = [chat_ids(tokenizer, row["prompt"]) for row in rows]
        warm, measured = ids[-1], ids[:-1]  # the warm-up prompt is not measured: graphs captured, allocators grown
        for name, plan, shape in methods:
            generate(name, shape, warm, args.max_new_tokens)
        table = {f"{name}/{plan}": [] for name, plan, _ in methods}
        for i, prompt in enumerate(measured):
            for name, plan, shape in methods:  # interleaved: a drift in speed hits every method alike
                reply, wall = generate(name, shape, prompt, args.max_new_tokens)
                s = reply.stats
                table[f"{name}/{plan}"].append({
                    "tokens": list(reply.token_ids), "wall_s": wall, "rounds": s.rounds, "draft_ms": s.draft_compute_ms,
                    "verify_ms": s.verify_compute_ms, "wire_ms": s.wire_serialization_ms, "plan_rounds": dict(s.plan_rounds),
                })
            print(f"{kind} prompt {i + 1}/{len(measured)} done", flush=True)
        sets[kind] = summarize(table)
        for row in sets[kind]:
            print(kind, json.dumps(row), flush=True)
        path.write_text(json.dumps({
            "device": args.device, "verifier": Path(args.verifier).name, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "row_buckets": os.environ.get("SPECDEC_CUDA_ROW_BUCKETS", "16"), "sets": sets,
        }, indent=1))


def summarize(table: dict[str, list[dict]]) -> list[dict]:
    alone = table["suffix/verifier alone"]
    base = sum(len(r["tokens"]) for r in alone) / sum(r["wall_s"] for r in alone)
    summary = []
    for method, rows in table.items():
        tokens, wall, rounds = sum(len(r["tokens"]) for r in rows), sum(r["wall_s"] for r in rows), sum(r["rounds"] for r in rows)
        plan_rounds: dict[str, int] = {}
        for r in rows:
            for plan, n in r["plan_rounds"].items():
                plan_rounds[plan] = plan_rounds.get(plan, 0) + n
        summary.append({
            "method": method, "tokens": tokens, "tokens_per_s": tokens / wall, "speedup": tokens / wall / base,
            "tokens_per_round": tokens / max(rounds, 1), "rounds": rounds,
            "ms_per_round": {part: sum(r[f"{part}_ms"] for r in rows) / max(rounds, 1) for part in ("draft", "verify", "wire")},
            "plan_rounds": plan_rounds, "outputs_equal_verifier_alone": all(r["tokens"] == a["tokens"] for r, a in zip(rows, alone)),
        })
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(4.5 * len(sets), 4), sharey=True, squeeze=False)
    for ax, (kind, rows) in zip(axes[0], sets.items()):
        names = [r["method"].replace("/", "\n") for r in rows]
        colors = ["grey"] + ["tab:blue" if r["method"].startswith("suffix") else "tab:orange" for r in rows[1:]]
        ax.bar(names, [r["speedup"] for r in rows], color=colors)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{kind} (verifier alone {rows[0]['tokens_per_s']:.0f} tok/s)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_ylabel("tokens/s over the verifier alone")
    fig.suptitle(f"Qwen2.5-Coder-1.5B-Instruct, bfloat16 on {results['device']} (greedy, served through gRPC)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
