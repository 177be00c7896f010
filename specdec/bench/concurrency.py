"""`specdec bench --concurrency 1,4,8,16,32`: many streams at once through one stack.

At each level, N clients send one request each at the same moment (held-out prompts in
turn): a burst. The policies take turns, --concurrency-repeats turns, each turn in the next of
their orders (6 repeats visit all): the verifier alone, a fixed speculation plan and the
adaptive controller. At low levels a turn is several waves (every level measures at least
--num-prompts requests a turn), and the policies take turns at every wave, on the same
prompts: a burst of one stream lasts a second, the machine's speed wanders over tens. The services batch
the rounds of the sessions that arrive together (specdec/core/batching.py). Reports aggregate
tokens/s, per-stream latency (p50, p99 of the request and of its ms per token) and the plans
run; checks every greedy output against the same prompt decoded alone, and adaptive's share of
the best fixed policy, paired by turn. Writes JSON rows, a plot and the checks.
"""
from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from specdec.bench.network import summed_plan_rounds
from specdec.bench.stats import paired_geometric_mean


def concurrency_policies(tree_method: str, budget: int) -> list[tuple[str, dict]]:
    from specdec.v1 import common_pb2

    return [
        ("verifier-alone", {"num_draft_tokens": 0, "adaptive": False}),
        (f"{tree_method}-{budget}", {"num_draft_tokens": budget, "tree": common_pb2.TreeShape(method=tree_method), "adaptive": False}),
        ("adaptive", {"adaptive": True}),
    ]


def run_concurrency(args, config, chat_ids: list[list[int]], app_args: dict, tree_method: str, budget: int) -> dict:
    from specdec.serving.client import CoordinatorClient, generate_request, server_token
    from specdec.app.launch import start_stack, stop_stack

    levels = [int(n) for n in args.concurrency.split(",")]
    limit = config.limits.max_concurrent_requests
    if max(levels) > limit:
        raise SystemExit(f"--concurrency {max(levels)} exceeds limits.max_concurrent_requests ({limit}) of the config")
    policies = concurrency_policies(tree_method, budget)
    sequence = turns(policies, args.concurrency_repeats)  # the same at every level
    address = args.address or start_stack(app_args, args.port, proxies=False)
    clients = [CoordinatorClient(address, server_token(config)) for _ in range(max(levels))]

    def request(ids: list[int], fields: dict, length: int = args.max_new_tokens):
        return generate_request(prompt_token_ids=ids, max_new_tokens=length, **fields)

    rows, mismatches = [], []
    try:
        # Each prompt decoded alone (the verifier alone), the reference of every greedy output.
        reference = [list(clients[0].generate(request(ids, policies[0][1])).token_ids) for ids in tqdm(chat_ids, desc="references")]
        clients[0].generate(request(chat_ids[0], {"adaptive": True}, 4 * args.max_new_tokens))  # the controller measures its plans
        for level in tqdm(levels, desc="concurrency", unit="level"):
            waves = -(-len(chat_ids) // level)  # each client sends one request a wave
            measured = {name: ([], 0.0, []) for name, _ in policies}
            for turn, wave in itertools.product(sequence, range(waves)):
                prompts = [(wave * level + i) % len(chat_ids) for i in range(level)]
                for name, fields in turn:
                    outcomes, wall = _burst(clients[:level], [chat_ids[j] for j in prompts], lambda ids, f=fields: request(ids, f))
                    for j, (tokens, _, _) in zip(prompts, outcomes):
                        if tokens != reference[j]:
                            mismatches.append({"concurrency": level, "policy": name, "prompt": j})
                    before, seconds, bursts = measured[name]
                    tokens = sum(len(t) for t, _, _ in outcomes)
                    measured[name] = (before + outcomes, seconds + wall, bursts + [tokens / wall])
            rows += [_row(level, name, seconds, outcomes, bursts) for name, (outcomes, seconds, bursts) in measured.items()]
    finally:
        for client in clients:
            client.close()
        if not args.address:
            stop_stack()
    return {"levels": levels, "policies": [n for n, _ in policies], "results": rows, "mismatches": mismatches,
            "checks": concurrency_checks(rows, mismatches)}


def turns(policies: list, repeats: int) -> list[tuple]:
    """The order of the policies' bursts in each turn. They take turns, so drift hits all
    alike, each turn in another of their orders, and the orders come in the sequence that has
    each policy right after every other as evenly as can be, across turns too (a burst after
    a speculative one ran ~5% slower, ad hoc; a plain rotation keeps the cyclic order, so
    adaptive always came right after the speculative burst). Three policies: the best of the
    720 sequences of their 6 orders, repeated."""
    orders = list(itertools.permutations(range(len(policies))))

    def imbalance(sequence: tuple[tuple[int, ...], ...]) -> tuple[int, int]:
        order = [p for turn in sequence for p in turn]
        follows = Counter(zip(order, order[1:]))
        spread = max(follows.values()) - min(follows[a, b] for a in range(len(policies)) for b in range(len(policies)) if a != b)
        return sum(a == b for a, b in zip(order, order[1:])), spread

    best = min(itertools.permutations(orders), key=imbalance)
    return [tuple(policies[i] for i in best[repeat % len(best)]) for repeat in range(repeats)]


def _burst(clients: list, prompts: list[list[int]], request) -> tuple[list, float]:
    """One request from each client, prompt i from client i, all at once: each request's
    (token ids, seconds, stats), and the wall time of the whole burst."""
    outcomes = [None] * len(prompts)

    def stream(i: int) -> None:
        start = time.perf_counter()
        response = clients[i].generate(request(prompts[i]))
        outcomes[i] = (list(response.token_ids), time.perf_counter() - start, response.stats)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any(o is None for o in outcomes):
        raise RuntimeError(f"a stream failed at concurrency {len(clients)} (see the log)")
    return outcomes, time.perf_counter() - start


def _row(level: int, policy: str, wall: float, outcomes: list, bursts: list[float]) -> dict:
    """A policy's results at one level; `bursts`: each burst's tokens/s in the order run, so a
    reader sees how far the machine's speed drifted between them."""
    tokens = sum(len(t) for t, _, _ in outcomes)
    latencies = sorted(s for _, s, _ in outcomes)
    per_token = sorted(s * 1e3 / max(len(t), 1) for t, s, _ in outcomes)
    speculative = sum(s.speculative_rounds for _, _, s in outcomes)
    return {
        "concurrency": level,
        "policy": policy,
        "tokens_per_second": tokens / wall,
        "burst_tokens_per_second": bursts,
        "generated_tokens": tokens,
        "seconds": wall,
        "request_s": {"p50": _quantile(latencies, 0.5), "p99": _quantile(latencies, 0.99)},
        "ms_per_token": {"p50": _quantile(per_token, 0.5), "p99": _quantile(per_token, 0.99)},
        "mean_accepted_per_round": sum(s.accepted_draft_tokens for _, _, s in outcomes) / speculative if speculative else None,
        "plan_rounds": summed_plan_rounds([s for _, _, s in outcomes]),
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[round(q * 100) - 1]


def concurrency_checks(rows: list[dict], mismatches: list[dict]) -> list[dict]:
    """The bars of the many-sessions issue, evaluated on this run."""
    at = {(r["concurrency"], r["policy"]): r["tokens_per_second"] for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    checks = [{"check": "greedy outputs equal to each prompt decoded alone", "passed": not mismatches, "mismatches": len(mismatches)}]
    for policy in sorted({r["policy"] for r in rows}):
        if (levels[0], policy) in at:
            scale = at[levels[-1], policy] / at[levels[0], policy]
            checks.append(
                {"check": f"{policy}: aggregate at {levels[-1]} streams >= 3x at {levels[0]}", "value": scale, "passed": scale >= 3}
            )
    bursts = {(r["concurrency"], r["policy"]): r["burst_tokens_per_second"] for r in rows}
    for level in levels:
        best = max((p for n, p in at if n == level and p != "adaptive"), key=lambda p: at[level, p])
        # Each wave of the policies pairs an adaptive burst with the best fixed one's, on the same
        # prompts: their ratios cancel the drift between waves (the machine's speed wanders by
        # more than 5%).
        share, low, high = paired_geometric_mean([a / b for a, b in zip(bursts[level, "adaptive"], bursts[level, best])])
        checks.append({
            "check": f"adaptive >= 95% of the best fixed policy at {level} streams", "value": share, "interval": [low, high],
            "best_fixed": best, "aggregate": at[level, "adaptive"] / at[level, best], "passed": share >= 0.95,
        })
    return checks


def format_concurrency(report: dict) -> str:
    lines = [
        f"{'streams':>7}  {'policy':<16} {'tok/s':>7} {'bursts':>13} {'req p50 s':>9} {'req p99 s':>9} "
        f"{'ms/tok p50':>10} {'ms/tok p99':>10}  plans"
    ]
    for r in report["results"]:
        bursts = r.get("burst_tokens_per_second") or [r["tokens_per_second"]]
        lines.append(
            f"{r['concurrency']:>7}  {r['policy']:<16} {r['tokens_per_second']:7.1f} {f'{min(bursts):.0f}-{max(bursts):.0f}':>13} "
            f"{r['request_s']['p50']:9.2f} {r['request_s']['p99']:9.2f} {r['ms_per_token']['p50']:10.1f} {r['ms_per_token']['p99']:10.1f}  "
            f"{r['plan_rounds']}"
        )
    lines += [f"{'PASS' if c['passed'] else 'FAIL'}  {c['check']}" + _check_value(c) for c in report["checks"]]
    return "\n".join(lines)


def _check_value(check: dict) -> str:
    if "interval" in check:
        low, high = check["interval"]
        return f" ({check['value']:.2f} [{low:.2f}, {high:.2f}] paired by wave; totals {check['aggregate']:.2f})"
    return f" ({check['value']:.2f})" if "value" in check else ""


def plot_concurrency(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in report["policies"]:
        rows = [r for r in report["results"] if r["policy"] == policy]
        levels = [r["concurrency"] for r in rows]
        throughput.plot(levels, [r["tokens_per_second"] for r in rows], marker="o", label=policy)
        line = latency.plot(levels, [r["ms_per_token"]["p50"] for r in rows], marker="o", label=f"{policy} p50")[0]
        latency.plot(
            levels, [r["ms_per_token"]["p99"] for r in rows], marker="x", linestyle="--", color=line.get_color(), label=f"{policy} p99"
        )
    throughput.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput", xscale="log", xticks=report["levels"])
    latency.set(
        xlabel="concurrent streams", ylabel="ms per token of a stream", title="per-stream latency", xscale="log", yscale="log",
        xticks=report["levels"],
    )
    for axes in (throughput, latency):
        axes.set_xticklabels([str(n) for n in report["levels"]])
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
