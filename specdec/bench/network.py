"""`specdec bench --rtt-sweep 0,5,20,50,100`: every speculation policy at every emulated
round-trip time, side by side on the same prompts.

For each RTT the application is redeployed with the latency injector on both service links
(half the RTT each way; `--jitter-ms`, `--bandwidth-mbps`), then these policies run on the
same held-out prompts, greedy and at T=1: fixed chains, fixed trees, the verifier alone
(`fused`), the adaptive controller with overlapped drafting off and on, and chosen fixed chains
with overlapped drafting on (`--sweep-overlap-chains`), which show what overlap hides wherever
speculation runs, whether or not the adaptive controller chooses it. The adaptive
controllers first serve one untimed warm-up request (4x the length), in which they measure
every plan, as a long-running server would have done long before. The policies take turns on
each prompt, so a drift in the machine's speed during the run hits them all alike.
Writes JSON rows (`rtt_ms`, `policy`, ...), a plot of tokens/s against RTT, and the checks.
"""
from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from specdec.bench.stats import turn_order


SPLIT, COLOCATED = "split", "colocated"  # where the verifier runs: its own deployment, or inside the coordinator


def sweep_policies(chains: list[int], trees: list[int], tree_method: str, overlap_chains: list[int] = ()) -> list[tuple[str, dict]]:
    """(policy name, GenerateRequest fields) for every policy of the sweep."""
    from specdec.v1 import common_pb2

    chain = common_pb2.TreeShape(method="chain")  # not the config's tree, which may be another method
    policies = [(f"chain-{b}", {"num_draft_tokens": b, "tree": chain, "adaptive": False, "overlap": False}) for b in chains]
    policies += [(f"chain-{b}+overlap", {"num_draft_tokens": b, "tree": chain, "adaptive": False, "overlap": True}) for b in overlap_chains]
    policies += [
        (
            f"{tree_method}-{b}",
            {"num_draft_tokens": b, "tree": common_pb2.TreeShape(method=tree_method), "adaptive": False, "overlap": False},
        )
        for b in trees
    ]
    policies += [
        ("fused", {"num_draft_tokens": 0, "adaptive": False, "overlap": False}),
        ("adaptive", {"adaptive": True, "overlap": False}),
        ("adaptive+overlap", {"adaptive": True, "overlap": True}),
    ]
    return policies


def run_rtt_sweep(args, config, chat_ids: list[list[int]], app_args: dict, placements: list[str]) -> dict:
    from ray import serve

    from specdec.serving.client import CoordinatorClient, generate_request, server_token
    from specdec.app.launch import beside_name, start_beside, stop_stack

    rtts = [float(r) for r in args.rtt_sweep.split(",")]
    temperatures = [float(t) for t in args.temperature.split(",")]
    chains = [int(b) for b in args.sweep_chains.split(",")]
    trees = [int(b) for b in args.sweep_trees.split(",")]
    overlap_chains = [int(b) for b in args.sweep_overlap_chains.split(",") if b]
    policies = sweep_policies(chains, trees, config.coordinator.adaptive.tree_method, overlap_chains)
    adaptive = {"chain_budgets": chains, "tree_budgets": trees}
    rows = []
    stacks = 0
    try:
        for rtt in rtts:
            link = {"rtt_ms": rtt, "jitter_ms": args.jitter_ms, "bandwidth_mbps": args.bandwidth_mbps}
            clients = {}
            for placement in placements:  # a stack each, side by side: the verifier beside the coordinator has no link
                port = args.port + stacks  # the previous coordinator may still hold the last port
                colocated = placement == COLOCATED
                network = {"drafter": link, "verifier": {} if colocated else link}
                # No prefix cache: each policy prefills each prompt, not only the one that ran it first.
                rtt_args = {**app_args,
                            "coordinator": {"port": port, "network": network, "adaptive": adaptive, "verifier_in_process": colocated},
                            "verifier": {"prefix_cache_mib": 0}}
                address = start_beside(rtt_args, port, stacks)
                clients[placement] = CoordinatorClient(address, server_token(config))
                stacks += 1
            turns = [(placement, name, fields) for placement in placements for name, fields in policies]
            for temperature in temperatures:
                def request(j: int, ids: list[int], fields: dict, length: int = args.max_new_tokens):
                    return generate_request(
                        prompt_token_ids=ids, max_new_tokens=length, temperature=temperature, seed=args.seed + j, **fields
                    )

                for placement, name, fields in turns:
                    if fields.get("adaptive"):  # untimed warm-up: the controller measures every plan first
                        clients[placement].generate(request(len(chat_ids), chat_ids[-1], fields, 4 * args.max_new_tokens))
                measured = {(placement, name): {"tokens": 0, "seconds": 0.0, "stats": []} for placement, name, _ in turns}
                for j, ids in enumerate(tqdm(chat_ids, desc=f"RTT {rtt:g} ms, T={temperature:g}", unit="prompt")):
                    for placement, name, fields in turn_order(turns, j):
                        start = time.perf_counter()
                        response = clients[placement].generate(request(j, ids, fields))
                        measured[placement, name]["seconds"] += time.perf_counter() - start
                        measured[placement, name]["tokens"] += len(response.token_ids)
                        measured[placement, name]["stats"].append(response.stats)
                rows += [_row(rtt, placement, name, temperature, **m) for (placement, name), m in measured.items()]
            for client in clients.values():
                client.close()
            for j in range(stacks - len(placements), stacks):  # this RTT's stacks leave the cores to the next
                serve.delete(beside_name(j))
    finally:
        if not args.address:
            stop_stack()
    return {
        "rtts": rtts, "placements": placements, "policies": [name for name, _ in policies], "results": rows, "checks": sweep_checks(rows)
    }


def _row(rtt: float, placement: str, policy: str, temperature: float, tokens: int, seconds: float, stats: list) -> dict:
    rounds = sum(s.rounds for s in stats)
    total_ms = sum(s.total_ms for s in stats)
    plan_rounds = summed_plan_rounds(stats)
    speculative = sum(s.rounds for s in stats) - plan_rounds.get("fused", 0)
    return {
        "rtt_ms": rtt,
        "placement": placement,
        "policy": policy,
        "temperature": temperature,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "generated_tokens": tokens,
        "mean_accepted_per_round": sum(s.accepted_draft_tokens for s in stats) / speculative if speculative else None,
        "mean_budget": sum(s.mean_budget * s.rounds for s in stats) / rounds if rounds else 0.0,
        "plan_rounds": plan_rounds,
        "overlap_hits": sum(s.overlap_hits for s in stats),
        "round_ms": {
            "draft_compute": sum(s.draft_compute_ms for s in stats) / rounds,
            "verify_compute": sum(s.verify_compute_ms for s in stats) / rounds,
            "draft_wire": sum(s.draft_wire_ms for s in stats) / rounds,
            "verify_wire": sum(s.verify_wire_ms for s in stats) / rounds,
            "serialization": sum(s.serialization_ms for s in stats) / rounds,
            "total": total_ms / rounds,
        },
        "wire_share": sum(s.wire_serialization_ms for s in stats) / total_ms if total_ms else None,
        "bytes_per_round": sum(s.bytes_sent + s.bytes_received for s in stats) / rounds if rounds else None,
    }


def summed_plan_rounds(stats: list) -> dict[str, int]:
    """Rounds per plan over several requests' RoundStats."""
    total: dict[str, int] = {}
    for s in stats:
        for plan, n in s.plan_rounds.items():
            total[plan] = total.get(plan, 0) + n
    return total


def sweep_checks(rows: list[dict]) -> list[dict]:
    """The bar of the network issue, evaluated on this run."""
    checks = []
    for placement, temperature, rtt in sorted({(r.get("placement") or "", r["temperature"], r["rtt_ms"]) for r in rows}):
        at = {r["policy"]: r for r in rows if (r.get("placement") or "", r["rtt_ms"], r["temperature"]) == (placement, rtt, temperature)}
        fixed = {p: r["tokens_per_second"] for p, r in at.items() if not p.startswith("adaptive")}
        best = max(fixed, key=fixed.get)
        adaptive = at["adaptive"]["tokens_per_second"]
        checks.append(
            {
                "placement": placement,
                "rtt_ms": rtt,
                "temperature": temperature,
                "best_fixed": best,
                "adaptive_vs_best_fixed": adaptive / fixed[best],
                "adaptive_vs_fused": adaptive / fixed["fused"],
                "overlap_on_vs_off": at["adaptive+overlap"]["tokens_per_second"] / adaptive,
                "fixed_overlap_on_vs_off": {
                    p: r["tokens_per_second"] / at[p.removesuffix("+overlap")]["tokens_per_second"]
                    for p, r in at.items() if p.startswith("chain-") and p.endswith("+overlap")
                },
                "wire_share_of_round_time": {p: r["wire_share"] for p, r in at.items()},
            }
        )
    return checks


def plot_sweep(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6.5 * len(temperatures), 4.5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        placements = report.get("placements") or [None]
        for placement, policy in ((p, q) for p in placements for q in report["policies"]):
            line = sorted((r["rtt_ms"], r["tokens_per_second"]) for r in rows
                          if (r["policy"], r["temperature"], r.get("placement")) == (policy, temperature, placement))
            style = {"linewidth": 2.5} if policy.startswith("adaptive") else {"linestyle": "--" if policy == "fused" else "-", "alpha": 0.7}
            if placement == COLOCATED:
                style["marker"] = "s"
            label = f"{placement}/{policy}" if len(placements) > 1 else policy
            ax.plot([x for x, _ in line], [y for _, y in line], **{"marker": "o", **style}, label=label)
        ax.set_title(f"T = {temperature:g}")
        ax.set_xlabel("added round-trip time per service link (ms)")
        ax.set_ylabel("tokens / s")
        ax.legend(fontsize=8)
    fig.suptitle("specdec bench --rtt-sweep: tokens/s against network latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_sweep(report: dict) -> str:
    lines = [
        "| RTT ms | placement | T | policy | tokens/s | accepted/round | mean budget | overlap hits | wire share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        accepted = "-" if r["mean_accepted_per_round"] is None else f"{r['mean_accepted_per_round']:.2f}"
        lines.append(
            f"| {r['rtt_ms']:g} | {r.get('placement') or '-'} | {r['temperature']:g} | {r['policy']} | {r['tokens_per_second']:.2f} | "
            f"{accepted} | "
            f"{r['mean_budget']:.1f} | {r['overlap_hits']} | {r['wire_share']:.1%} |"
        )
    lines += [
        "",
        (
            "| RTT ms | placement | T | best fixed | adaptive / best fixed | adaptive / fused | overlap on / off (adaptive) | "
            "overlap on / off (fixed chains) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in report["checks"]:
        fixed_overlap = ", ".join(f"{p.removesuffix('+overlap')}: {ratio:.2f}" for p, ratio in c["fixed_overlap_on_vs_off"].items()) or "-"
        lines.append(
            f"| {c['rtt_ms']:g} | {c['placement'] or '-'} | {c['temperature']:g} | {c['best_fixed']} | {c['adaptive_vs_best_fixed']:.2f} | "
            f"{c['adaptive_vs_fused']:.2f} | {c['overlap_on_vs_off']:.2f} | {fixed_overlap} |"
        )
    return "\n".join(lines)
