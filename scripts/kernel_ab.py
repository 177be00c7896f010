"""A/B two versions of the engine's native kernels in one process: both builds loaded, the
served verifier's forward for k new tokens after a committed context run with each in turn,
forward by forward (this machine's speed drifts by +-25% over seconds, so only pairs taken
moments apart compare). Prints and saves each build's median time and the median of the
paired ratios new/base with its quartiles.

    .venv/bin/python scripts/kernel_ab.py --base HEAD~1 --tokens 1,9,17 --context 200 --pairs 40

`--contention BUSY_MS,IDLE_MS[,NICE]` adds a second process that keeps one core busy for BUSY_MS
every BUSY_MS + IDLE_MS (at niceness NICE, default 0), as a served verifier's neighbours on the
machine do (the drafter, the coordinator, Ray): every forward is then taken twice, with the
neighbour running and stopped, in turn, and the builds compare under it; each build's rows also
give the paired slowdown.

`--base` and `--new` name git revisions of the kernels (specdec/core/kernels/*.cpp, *.h); `--new`
defaults to the working tree. Both builds must pack weights alike (checked: the model's
weights are packed once, by the build the engine loaded) and take the same arguments from
specdec/core/engine.py (the working tree's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import specdec.core.engine as engine_module
import specdec.core.int8 as int8_module
from specdec.core.kernels import KERNEL_DIR, SOURCE_SUFFIXES, build, sources
from specdec.core.models import load_model
from specdec.serving.config import load_config

REPO = Path(__file__).resolve().parents[1]


def use(kernels) -> None:
    """Makes `kernels` the build the engine's attention and the int8 layers ask for (each call)."""
    engine_module.native = int8_module.native = lambda: kernels


def sources_at(revision: str | None) -> dict[str, str]:
    """The kernels' source files at a git revision (None: the working tree)."""
    if revision is None:
        return sources()
    folder = KERNEL_DIR.relative_to(REPO).as_posix()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout

    names = [Path(path).name for path in git("ls-tree", "--name-only", f"{revision}:{folder}/").split() if path.endswith(SOURCE_SUFFIXES)]
    return {name: git("show", f"{revision}:{folder}/{name}") for name in names}


def contend(busy_ms: float, idle_ms: float, niceness: int = 0) -> subprocess.Popen:
    """A process at `niceness` that spins for busy_ms, then sleeps for idle_ms, until killed."""
    loop = (
        "import time\n"
        "while True:\n"
        f"    end = time.perf_counter() + {busy_ms / 1e3}\n"
        "    while time.perf_counter() < end: pass\n"
        f"    time.sleep({idle_ms / 1e3})\n"
    )
    return subprocess.Popen([sys.executable, "-c", loop], preexec_fn=lambda: os.nice(niceness))


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision of the kernels to compare against")
    parser.add_argument("--new", default=None, help="git revision of the new kernels (default: the working tree)")
    parser.add_argument("--tokens", default="1,9,17", help="comma-separated new-token counts k")
    parser.add_argument("--context", type=int, default=200, help="committed context length")
    parser.add_argument("--pairs", type=int, default=40, help="forwards per build and k")
    parser.add_argument("--config", default=None, help="YAML config whose verifier is measured")
    parser.add_argument("--contention", default=None, metavar="BUSY_MS,IDLE_MS[,NICE]",
                        help="a process busy BUSY_MS of every BUSY_MS + IDLE_MS on one core, stopped for every other forward")
    parser.add_argument("--out", default="runs/kernel_ab.json")
    args = parser.parse_args()
    busy_ms, idle_ms, *niceness = (float(v) for v in args.contention.split(",")) if args.contention else (0.0, 0.0)

    builds = {"base": build(sources_at(args.base)), "new": build(sources_at(args.new))}
    probe = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    if not torch.equal(builds["base"].pack_weight(probe), builds["new"].pack_weight(probe)):
        raise SystemExit("the two builds pack weights differently: their forwards cannot share one loaded model")
    spec = load_config(args.config).verifier.model
    model = load_model(spec)
    engine = engine_module.engine_for(model, spec.dtype)
    if getattr(engine, "native_layers", None) is None:
        raise SystemExit(f"the verifier ({spec.dtype}) does not run on the native kernels")
    layers = {}  # each build's own layer objects (one build's LayerWeights is a type the other does not know)
    for name, kernels in builds.items():
        use(kernels)
        layers[name] = engine._native_layers(model.config)
    tokens = [int(k) for k in args.tokens.split(",")]
    ids = torch.randint(1000, 40000, (args.context + max(tokens),), generator=torch.Generator().manual_seed(0)).tolist()
    conditions = ("busy", "quiet") if args.contention else ("quiet",)
    times: dict[tuple[str, int, str], list[float]] = {(name, k, c): [] for name in builds for k in tokens for c in conditions}
    contender = contend(busy_ms, idle_ms, int(niceness[0]) if niceness else 0) if args.contention else None
    with torch.inference_mode():
        # the context read by one build throughout (the engine's own layers are the working tree's build,
        # which with --new REV is neither of the two)
        use(builds["base"])
        engine.native_layers, engine.lm_head.kernels = layers["base"], builds["base"]
        cache = engine.new_cache()
        engine(cache, ids[: args.context])
        for pair in tqdm(range(args.pairs + 2), desc="pairs", unit="pair"):
            for k in tokens:
                for condition in conditions if pair % 2 else conditions[::-1]:
                    if contender is not None:
                        contender.send_signal(signal.SIGCONT if condition == "busy" else signal.SIGSTOP)
                    for name in ("base", "new") if pair % 2 else ("new", "base"):
                        kernels = builds[name]
                        use(kernels)
                        engine.native_layers, engine.lm_head.kernels = layers[name], kernels
                        cache.truncate(args.context)
                        start = time.perf_counter()
                        engine(cache, ids[args.context : args.context + k], num_logits=k)
                        if pair >= 2:  # the first two warm caches and allocators
                            times[(name, k, condition)].append((time.perf_counter() - start) * 1e3)
    if contender is not None:
        contender.kill()
    rows = []
    compared = conditions[0]  # under the neighbour, when there is one
    for k in tokens:
        base, new = times[("base", k, compared)], times[("new", k, compared)]
        low, ratio, high = quartiles([b / a for a, b in zip(base, new)])
        row = {"tokens": k, "context": args.context, "base_ms": statistics.median(base), "new_ms": statistics.median(new),
               "new_over_base": ratio, "quartiles": [low, high],
               "base_x_one_token": statistics.median(base) / statistics.median(times[("base", tokens[0], compared)]),
               "new_x_one_token": statistics.median(new) / statistics.median(times[("new", tokens[0], compared)])}
        line = f"k={k:3d}: base {row['base_ms']:7.2f} ms  new {row['new_ms']:7.2f} ms  new/base {ratio:.3f} [{low:.3f}, {high:.3f}]"
        if args.contention:
            for name in builds:
                busy, quiet = times[(name, k, "busy")], times[(name, k, "quiet")]
                row[f"{name}_quiet_ms"] = statistics.median(quiet)
                row[f"{name}_busy_over_quiet"] = quartiles([b / q for b, q in zip(busy, quiet)])[1]
                line += f"  {name} busy/quiet {row[f'{name}_busy_over_quiet']:.3f} (quiet {row[f'{name}_quiet_ms']:.2f} ms)"
        rows.append(row)
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"base": args.base, "new": args.new or "working tree", "contention": args.contention, "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
