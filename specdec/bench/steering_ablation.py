"""`specdec bench --steering-ablation`: SD² steering against its controls, in one run.

Three variants decode the same held-out prompts, greedy and at T=1, with the same tree
method and budget:
  steered         the steered drafter, with the verifier's steering vector each round
  unsteered       the same drafter, never given a vector
  distilled-only  a drafter distilled with the same recipe and budget, without steering
plus verifier-only decoding through the same services for the speed ratio. Prompts come in
two sets: held-out prompts of the categories the drafters trained on, and held-out prompts
of the categories left out of training (the out-of-distribution check; by default those the
steered drafter's recipe excluded). Writes JSON rows (each with a `steering` field), a plot
of accepted tokens per round, and the checks of the steering issue.
"""
from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from specdec.bench.stats import paired_ratio_interval
from specdec.core.drafter_checkpoint import is_drafter_checkpoint, read_meta
from specdec.core.hub import resolve_alias
from specdec.core.prompts import chat_ids, evaluation_split, load_prompts
from specdec.core.tree import TreeShape

VARIANTS = ("steered", "unsteered", "distilled-only")


def excluded_categories(drafter: str) -> list[str]:
    path = resolve_alias(drafter)
    return read_meta(path).get("recipe", {}).get("exclude_categories", []) if is_drafter_checkpoint(path) else []


def prompt_sets(args, ood: list[str]) -> dict[str, list[dict]]:
    rows = load_prompts(args.prompts)
    inside = [r for r in rows if r["category"] not in ood]
    sets = {"in-distribution": evaluation_split(inside, args.num_prompts, args.skip_prompts)}
    if ood:
        sets["out-of-distribution"] = evaluation_split([r for r in rows if r["category"] in ood], args.num_prompts, args.skip_prompts)
    return sets


def run_steering_ablation(args, config, app_args: dict, tokenizer, shape: TreeShape, budget: int) -> dict:
    from specdec.serving.client import CoordinatorClient, generate_request, server_token
    from specdec.app.launch import deploy, start_stack, stop_stack
    from specdec.serving.wire import shape_to_proto

    steered = args.steered_drafter or config.drafter.model.source
    if not args.distilled_drafter:
        raise SystemExit("--steering-ablation needs --distilled-drafter: the drafter distilled without steering on the same budget")
    ood = args.ood_categories.split(",") if args.ood_categories else excluded_categories(steered)
    sets = prompt_sets(args, ood)
    chat = {name: [chat_ids(tokenizer, p["prompt"]) for p in prompts] for name, prompts in sets.items()}
    temperatures = [float(t) for t in args.temperature.split(",")]
    tree = shape.method
    stacks = [
        (("steered", True), ("unsteered", False), ("verifier-only", False)),
        (("distilled-only", False),),
    ]
    drafters = [steered, args.distilled_drafter]
    rows = []
    greedy_outputs: dict[tuple[str, str], list[list[int]]] = {}  # (prompt set, variant) -> outputs
    try:
        for i, (variants, drafter) in enumerate(zip(stacks, drafters)):
            port = args.port + i
            stack_args = {
                **app_args,
                "coordinator": {"port": port},
                "drafter": {"model": {"source": drafter}},
                "steering_checkpoint": steered if i == 0 else "",
            }
            # One after the other: the second stack replaces the first under the same app name.
            address = start_stack(stack_args, port, proxies=False) if i == 0 else deploy(stack_args, port)
            client = CoordinatorClient(address, server_token(config))
            client.generate(generate_request(prompt="Hi", max_new_tokens=8, steering=i == 0))  # warm-up
            for temperature in temperatures:
                for set_name, prompts in chat.items():
                    for variant, steering in tqdm(variants, desc=f"{drafter} T={temperature:g} {set_name}", unit="variant"):
                        tokens, seconds, stats, outputs = 0, 0.0, [], []
                        for j, ids in enumerate(prompts):
                            request = generate_request(
                                prompt_token_ids=ids, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed + j,
                                num_draft_tokens=0 if variant == "verifier-only" else budget, tree=shape_to_proto(shape), steering=steering,
                                adaptive=False, overlap=False,
                            )
                            start = time.perf_counter()
                            response = client.generate(request)
                            seconds += time.perf_counter() - start
                            tokens += len(response.token_ids)
                            stats.append(response.stats)
                            outputs.append(list(response.token_ids))
                        row = _row(
                            variant, drafter, temperature, set_name, sorted({p["category"] for p in sets[set_name]}), tree, budget, tokens,
                            seconds, stats,
                        )
                        if temperature == 0:
                            greedy_outputs[(set_name, variant)] = outputs
                        rows.append(row)
            client.close()
    finally:
        if not args.address:
            stop_stack()
    for row in rows:  # exactness is against the served verifier alone
        if row["temperature"] == 0:
            alone = greedy_outputs[(row["prompt_set"], "verifier-only")]
            mine = greedy_outputs[(row["prompt_set"], row["steering"])]
            row["greedy_matches_verifier_alone"] = sum(a == b for a, b in zip(mine, alone)) / len(alone)
    _add_speedups(rows)
    return {
        "variants": list(VARIANTS),
        "drafters": {"steered": steered, "distilled-only": args.distilled_drafter},
        "ood_categories": ood,
        "question_ids": {name: [p["question_id"] for p in prompts] for name, prompts in sets.items()},
        "tree": tree,
        "budget": budget,
        "results": rows,
        "checks": steering_checks(rows),
    }


def _row(variant, drafter, temperature, set_name, categories, tree, budget, tokens, seconds, stats) -> dict:
    rounds = sum(s.rounds for s in stats)
    # Per prompt, in prompt order, so the checks can resample prompts for a confidence interval.
    accepted = [s.accepted_draft_tokens for s in stats]
    speculative = [s.rounds - s.plan_rounds.get("fused", 0) for s in stats]
    total_ms = sum(s.total_ms for s in stats)
    steering_ms = sum(s.verify_steering_ms + s.draft_steering_ms for s in stats)
    return {
        "steering": variant,
        "drafter": drafter,
        "temperature": temperature,
        "prompt_set": set_name,
        "categories": categories,
        "tree": tree if variant != "verifier-only" else None,
        "budget": budget if variant != "verifier-only" else 0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "generated_tokens": tokens,
        "mean_accepted_per_round": sum(accepted) / sum(speculative) if sum(speculative) else None,
        "accepted_per_prompt": accepted,
        "speculative_rounds_per_prompt": speculative,
        "steering_bytes_per_round": sum(s.steering_bytes for s in stats) / rounds,
        "verify_steering_ms_per_round": sum(s.verify_steering_ms for s in stats) / rounds,
        "draft_steering_ms_per_round": sum(s.draft_steering_ms for s in stats) / rounds,
        "draft_compute_ms_per_round": sum(s.draft_compute_ms for s in stats) / rounds,
        "round_ms": total_ms / rounds,
        "steering_share_of_round_time": steering_ms / total_ms if total_ms else 0.0,
    }


def _add_speedups(rows: list[dict]) -> None:
    for row in rows:
        base = next(
            r for r in rows
            if r["steering"] == "verifier-only" and r["temperature"] == row["temperature"] and r["prompt_set"] == row["prompt_set"]
        )
        row["speedup_vs_verifier_only"] = row["tokens_per_second"] / base["tokens_per_second"]


def gain_interval(treated: dict, control: dict, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% paired-bootstrap interval (over prompts) of treated's accepted-per-round gain over control's."""
    low, high = paired_ratio_interval(
        *[(r["accepted_per_prompt"], r["speculative_rounds_per_prompt"]) for r in (treated, control)], draws=draws, seed=seed
    )
    return low - 1, high - 1


def steering_checks(rows: list[dict]) -> list[dict]:
    """The bar of the steering issue, evaluated on this run."""
    checks = []
    for (temperature, set_name) in sorted({(r["temperature"], r["prompt_set"]) for r in rows}):
        at = {r["steering"]: r for r in rows if r["temperature"] == temperature and r["prompt_set"] == set_name}
        gain = at["steered"]["mean_accepted_per_round"] / at["distilled-only"]["mean_accepted_per_round"] - 1
        check = {
            "temperature": temperature,
            "prompt_set": set_name,
            "accepted_gain_vs_distilled_only": gain,
            "accepted_gain_vs_distilled_only_95ci": gain_interval(at["steered"], at["distilled-only"]),
            "accepted_gain_vs_unsteered": at["steered"]["mean_accepted_per_round"] / at["unsteered"]["mean_accepted_per_round"] - 1,
            "required_gain": 0.10 if temperature == 0 else 0.15,
            "steering_share_of_round_time": at["steered"]["steering_share_of_round_time"],
        }
        check["gain_met"] = gain >= check["required_gain"]
        check["cost_under_3_percent"] = check["steering_share_of_round_time"] < 0.03
        if temperature == 0:
            check["greedy_exact"] = all(r.get("greedy_matches_verifier_alone") == 1.0 for r in at.values())
        checks.append(check)
    return checks


def format_ablation(report: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [
        "| prompts | T | steering | accepted/round | tokens/s | vs verifier-only | steering B/round | "
        "steering ms/round (verifier + drafter) | share of round | greedy = generate() |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['prompt_set']} | {r['temperature']:g} | {r['steering']} | {fmt(r['mean_accepted_per_round'], '.3f')} | "
            f"{r['tokens_per_second']:.2f} | "
            f"{r['speedup_vs_verifier_only']:.2f}x | {r['steering_bytes_per_round']:.0f} | "
            f"{r['verify_steering_ms_per_round']:.2f} + {r['draft_steering_ms_per_round']:.2f} | "
            f"{r['steering_share_of_round_time']:.2%} | {fmt(r.get('greedy_matches_verifier_alone'), '.0%')} |"
        )
    lines.append("")
    for c in report["checks"]:
        lines.append(
            f"{c['prompt_set']}, T={c['temperature']:g}: steered vs distilled-only {c['accepted_gain_vs_distilled_only']:+.1%} "
            f"(95% CI over prompts {c['accepted_gain_vs_distilled_only_95ci'][0]:+.1%} "
            f"to {c['accepted_gain_vs_distilled_only_95ci'][1]:+.1%}) "
            f"(bar {c['required_gain']:+.0%}: {'met' if c['gain_met'] else 'NOT met'}), "
            f"vs unsteered {c['accepted_gain_vs_unsteered']:+.1%}, "
            f"steering {c['steering_share_of_round_time']:.2%} of round time"
        )
    return "\n".join(lines)


def plot_ablation(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["steering"] in VARIANTS]
    panels = sorted({(r["prompt_set"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (set_name, temperature) in zip(axes[0], panels):
        at = {r["steering"]: r for r in rows if r["prompt_set"] == set_name and r["temperature"] == temperature}
        values = [at[v]["mean_accepted_per_round"] or 0.0 for v in VARIANTS]
        ax.bar(VARIANTS, values, color=["tab:green", "tab:gray", "tab:blue"])
        for i, value in enumerate(values):
            ax.text(i, value, f"{value:.2f}", ha="center", va="bottom")
        check = next(c for c in report["checks"] if c["prompt_set"] == set_name and c["temperature"] == temperature)
        low, high = check["accepted_gain_vs_distilled_only_95ci"]
        ax.set_title(
            f"{set_name}, T = {temperature:g}\nsteered vs distilled-only {check['accepted_gain_vs_distilled_only']:+.0%} "
            f"(95% CI {low:+.0%} to {high:+.0%})",
            fontsize=10,
        )
        ax.set_ylabel("accepted draft tokens per round")
    fig.suptitle(f"SD² steering ablation ({report['tree']}, {report['budget']} draft tokens per round)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
