"""Greedy decoding through the plain gRPC servers (no Ray) with the verifier on a GPU: the
verifier alone vs speculation with the default feature-head drafter (on the CPU), tokens/s
measured at the client, outputs compared token for token.

    python scripts/gpu_served_bench.py --out OUT --prompts prompts.jsonl [--n 8] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specdec.serving.rpc import free_port

PORTS = {name: free_port() for name in ("drafter", "verifier", "coordinator")}


def start(name: str, args: list[str], log: Path) -> subprocess.Popen:
    handle = log.open("w")
    process = subprocess.Popen([sys.executable, "-u", "-m", name, *args], stdout=handle, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.time() + 600
    while time.time() < deadline:
        text = log.read_text()
        if " serving " in text:
            return process
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{text[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="where served_bench.json, the config and the servers' logs go")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter-dtype", default="float32")
    parser.add_argument("--verifier-device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "served.yaml"
    config.write_text(f"""
verifier:
  model: {{source: smollm2-135m-instruct, dtype: bfloat16, device: {args.verifier_device}}}
drafter:
  model: {{source: smollm2-135m-feature-head, dtype: {args.drafter_dtype}, device: cpu}}
  torch_threads: 4
""")
    processes = []
    try:
        processes.append(start("verifier_service", ["--config", str(config), "--port", str(PORTS["verifier"])], out / "verifier.log"))
        processes.append(start("drafter_service", ["--config", str(config), "--port", str(PORTS["drafter"])], out / "drafter.log"))
        processes.append(start("coordinator", ["--config", str(config), "--drafter", f"localhost:{PORTS['drafter']}",
                                               "--verifier", f"localhost:{PORTS['verifier']}", "--port", str(PORTS["coordinator"])],
                               out / "coordinator.log"))
        run(args, out)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


def run(args, out: Path) -> None:
    from specdec.serving.client import CoordinatorClient, generate_request
    from specdec.v1.common_pb2 import TreeShape

    prompts = [json.loads(line)["turns"][0] for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.n]
    modes = {
        "verifier alone": {"num_draft_tokens": 0},
        "chain-4": {"num_draft_tokens": 4, "tree": TreeShape(method="chain")},
        "dynamic-8": {"num_draft_tokens": 8, "tree": TreeShape(method="dynamic", width=4)},
        "dynamic-16": {"num_draft_tokens": 16, "tree": TreeShape(method="dynamic", width=4)},
    }
    client = CoordinatorClient(f"localhost:{PORTS['coordinator']}")
    for fields in modes.values():  # warm-up: graphs captured, allocators grown
        client.generate(generate_request(prompts[0], use_chat_template=True, max_new_tokens=32, temperature=0.0, adaptive=False, **fields))
    results = {name: [] for name in modes}
    for prompt in prompts:
        for name, fields in modes.items():  # interleaved: a drift in machine speed hits every mode alike
            begin = time.perf_counter()
            reply = client.generate(generate_request(prompt, use_chat_template=True, max_new_tokens=args.max_new_tokens, temperature=0.0,
                                                     adaptive=False, **fields))
            wall = time.perf_counter() - begin
            stats = reply.stats
            results[name].append({"tokens": list(reply.token_ids), "wall_s": wall, "rounds": stats.rounds,
                                  "verify_ms": stats.verify_compute_ms, "draft_ms": stats.draft_compute_ms})
    alone = results["verifier alone"]
    summary = []
    for name, rows in results.items():
        tokens = sum(len(r["tokens"]) for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        rounds = sum(r["rounds"] for r in rows)
        summary.append({
            "mode": name, "tokens": tokens, "tokens_per_s": tokens / wall, "tokens_per_round": tokens / max(rounds, 1),
            "verify_ms_per_round": sum(r["verify_ms"] for r in rows) / max(rounds, 1),
            "draft_ms_per_round": sum(r["draft_ms"] for r in rows) / max(rounds, 1),
            "outputs_equal_verifier_alone": all(r["tokens"] == a["tokens"] for r, a in zip(rows, alone)),
            "median_request_tokens_per_s": statistics.median(len(r["tokens"]) / r["wall_s"] for r in rows),
        })
    base = summary[0]["tokens_per_s"]
    for row in summary:
        row["speedup_vs_verifier_alone"] = row["tokens_per_s"] / base
        print(json.dumps(row), flush=True)
    (out / "served_bench.json").write_text(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                                                       "drafter_dtype": args.drafter_dtype, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
