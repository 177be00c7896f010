"""Compares divergences and data modes for the drafter recipe with short runs on the same
cached samples; writes JSON and prints a markdown table.

    .venv/bin/python scripts/distill_comparison.py --steps 80 --samples-from runs/default_drafter_v2
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml

from specdec.serving.config import parse
from specdec.train.distill import DistillConfig, run_distill

VARIANTS = [
    ("fkl", "mixed"), ("rkl", "mixed"), ("jsd", "mixed"), ("tvd", "mixed"),
    ("fkl", "teacher"), ("fkl", "on-policy"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="specdec/data/recipes/default_drafter.yaml")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--samples-from", help="a run directory whose samples.pt to reuse")
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--json", default="docs/benchmarks/distill_comparison.json")
    args = parser.parse_args()
    base = yaml.safe_load(Path(args.recipe).read_text())
    rows = []
    for divergence, data in VARIANTS:
        out = Path(args.out) / f"{divergence}-{data}"
        out.mkdir(parents=True, exist_ok=True)
        if args.samples_from and not (out / "samples.pt").exists():
            shutil.copy(Path(args.samples_from) / "samples.pt", out / "samples.pt")
        cfg = parse(DistillConfig, {**base, "divergence": divergence, "data": data, "steps": args.steps, "out": str(out)})
        report = run_distill(cfg)
        rows.append({
            "divergence": divergence, "data": data, "steps": args.steps, "before": report["before"], "after": report["after"],
            "seconds": report["seconds"],
        })
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print("| divergence | data | greedy agreement | acceptance 1 − TVD (T=1) | accepted / verify call (depth 4) |")
    print("|---|---|---|---|---|")
    for r in rows:
        a = r["after"]
        print(
            f"| {r['divergence']} | {r['data']} | {a['greedy_agreement']:.1%} | {a['sampling_acceptance_t1']:.1%} | "
            f"{a['accepted_per_verify_call_depth4']:.2f} |"
        )


if __name__ == "__main__":
    main()
