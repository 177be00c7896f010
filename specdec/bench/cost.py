"""`specdec bench --cost-curve`: what one forward costs for k new tokens after a committed
context, for the served engine (in each weight format asked for) and for float32 transformers, measured interleaved (every
repetition visits every engine and k in turn, so a drift in machine speed hits all alike).
The cost of k tokens relative to one is given both as a ratio of medians and as the geometric
mean of each repetition's own T(k) / T(1) with its 95% interval."""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.bench import llama_cpp
from specdec.bench.roofline import RoundRates
from specdec.bench.stats import paired_geometric_mean
from specdec.core.engine import TransformersEngine, engine_for
from specdec.core.feature_head import is_feature_head
from specdec.core.models import ModelSpec, load_model
from specdec.core.ngram import is_model_free
from specdec.core.timing import WARMUP_ROUNDS, pass_times


def _engines(config, formats: list[str] | None) -> dict[str, tuple[str, object]]:
    """name -> (role, engine): the served verifier (in each of `formats`, else in its own),
    float32 transformers, and the served drafter where it is a model."""
    served = config.verifier.model
    engines = {}
    for dtype in formats or [served.dtype]:  # named by the format served (dtype auto: the one it chose)
        model = load_model(dataclasses.replace(served, dtype=dtype))
        engines[f"served verifier ({model.weight_format})"] = ("verifier", engine_for(model, model.weight_format))
    if served.dtype != "float32":
        fp32 = ModelSpec(served.source, served.layers, "float32", served.device)
        engines["float32 transformers verifier"] = ("verifier", TransformersEngine(load_model(fp32)))
    drafter = config.drafter.model
    # A head is no causal LM of its own (its steps show in the served bench's draft_ms), an n-gram
    # drafter has no model, and a drafter of another tokenizer cannot read the verifier's context ids.
    if not is_feature_head(drafter.source) and not is_model_free(drafter.source) and config.drafter.tokenizer == "shared":
        model = load_model(drafter)
        engines[f"served drafter ({model.weight_format})"] = ("drafter", engine_for(model, model.weight_format))
    return engines


def run_cost_curve(config, context_ids: list[int], tokens: list[int], formats: list[str] | None = None, repeats: int = 24,
                   with_roofline: bool = False) -> dict:
    """The rows of time_engines; with_roofline reads the machine's rates after every round
    (bench/roofline.py) and adds each verifier engine's roof to its rows and to the report."""
    engines = _engines(config, formats)
    gguf = llama_cpp.verifier_gguf(config.verifier.model.source) if llama_cpp.bench_built() else None
    rates = None
    if with_roofline:
        rates = RoundRates({name: engine.model if isinstance(engine, TransformersEngine) else engine
                            for name, (role, engine) in engines.items() if role == "verifier"})
    rows = time_engines(engines, context_ids, tokens, repeats, llama_cpp_gguf=gguf, rates=rates)
    if rates is None:
        return {"results": rows}
    return {"results": rows, "roofline": {name: rates.roof(name) for name in rates.models}}


LLAMA_CPP = "llama.cpp (llama-bench, the same file)"


def time_engines(engines: dict[str, tuple[str, object]], context_ids: list[int], tokens: list[int], repeats: int = 24,
                 llama_cpp_gguf: Path | None = None, rates: RoundRates | None = None) -> list[dict]:
    """Each engine's pass of k new tokens after `context_ids` (a drafter's: one token), interleaved;
    with `llama_cpp_gguf`, llama.cpp's passes over that file too, one llama-bench run after each round;
    with `rates` (a roofline.RoundRates), the machine's rates read after each round's passes, and
    each of its engines' rows set against the roof of the round they ran in."""
    threads = torch.get_num_threads()
    llama_times: dict[tuple[str, int], list[float]] = {}

    def rounds(repetitions: range):
        for repeat in tqdm(repetitions, desc="cost curve", unit="round"):
            yield repeat  # pass_times runs the round's passes, then the rates and llama.cpp's follow them
            if repeat < WARMUP_ROUNDS:
                continue
            if rates is not None:
                rates.read()
            if llama_cpp_gguf is not None:
                for k, ms in llama_cpp.pass_ms(llama_cpp_gguf, tokens, len(context_ids), threads).items():
                    llama_times.setdefault((LLAMA_CPP, k), []).append(ms)

    times = pass_times(
        {name: (engine, tokens if role == "verifier" else [1]) for name, (role, engine) in engines.items()}, context_ids, repeats, rounds,
    ) | llama_times
    curves = {name: role for name, (role, _) in engines.items()}
    if llama_cpp_gguf is not None:
        curves[LLAMA_CPP] = "verifier"
    rows = []
    for name, role in curves.items():
        one = statistics.median(times[(name, 1)])
        for k in tokens if role == "verifier" else [1]:
            median = statistics.median(times[(name, k)])
            # T(k) over T(1) of the same repetition, moments apart: the machine's drift between
            # repetitions cancels, which it does not in a ratio of medians
            paired, low, high = paired_geometric_mean([a / b for a, b in zip(times[(name, k)], times[(name, 1)])])
            rows.append({
                "method": "cost_curve", "engine": name, "model": role, "tokens": k, "context": len(context_ids),
                ("verify_ms" if role == "verifier" else "draft_step_ms"): median, "ratio_to_one_token": median / one,
                "paired_ratio_to_one_token": paired, "paired_interval": [low, high],
            })
            if rates is not None and name in rates.models:
                roofs = rates.roof_ms_by_round(name, k)
                paired, low, high = paired_geometric_mean([t / roof for t, roof in zip(times[(name, k)], roofs)])
                rows[-1] |= {"roof_ms": statistics.median(roofs), "paired_ratio_to_roof": paired, "paired_roof_interval": [low, high]}
    return rows


def format_cost_curve(rows: list[dict]) -> str:
    lines = ["engine | tokens | ms (median) | x one token (medians) | x one token (paired, 95%) | roof ms | x roof (paired, 95%)",
             "---|---|---|---|---|---|---"]
    for r in rows:
        ms = r.get("verify_ms", r.get("draft_step_ms"))
        low, high = r["paired_interval"]
        roof = "- | -"
        if "roof_ms" in r:
            roof_low, roof_high = r["paired_roof_interval"]
            roof = f"{r['roof_ms']:.1f} | {r['paired_ratio_to_roof']:.2f} [{roof_low:.2f}, {roof_high:.2f}]"
        lines.append(
            f"{r['engine']} | {r['tokens']} | {ms:.1f} | {r['ratio_to_one_token']:.2f} | "
            f"{r['paired_ratio_to_one_token']:.2f} [{low:.2f}, {high:.2f}] | {roof}"
        )
    return "\n".join(lines)


def _paired_bars(ax, ks: list[int], rows: list[dict], ratio: str, interval: str, **style) -> None:
    """Each row's paired ratio with its 95% interval as error bars."""
    centre = [r[ratio] for r in rows]
    spread = [[c - r[interval][0] for c, r in zip(centre, rows)], [r[interval][1] - c for c, r in zip(centre, rows)]]
    ax.errorbar(ks, centre, yerr=spread, marker="o", capsize=3, **style)


def plot_cost_curve(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = [r for r in rows if r["model"] == "drafter"]
    roofed = any("roof_ms" in r for r in rows)
    panels = 2 + roofed + bool(drafters)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    absolute, relative = axes[:2]
    colors = {}
    for name in dict.fromkeys(r["engine"] for r in rows if r["model"] == "verifier"):
        mine = [r for r in rows if r["engine"] == name]
        ks = [r["tokens"] for r in mine]
        (line,) = absolute.plot(ks, [r["verify_ms"] for r in mine], marker="o", label=name)
        colors[name] = line.get_color()
        if "roof_ms" in mine[0]:
            absolute.plot(ks, [r["roof_ms"] for r in mine], linestyle="--", color=line.get_color(), label=f"{name}: roof")
        _paired_bars(relative, ks, mine, "paired_ratio_to_one_token", "paired_interval", label=name)
        if "roof_ms" in mine[0]:
            _paired_bars(axes[2], ks, mine, "paired_ratio_to_roof", "paired_roof_interval", color=line.get_color(), label=name)
    if roofed:
        axes[2].set(xscale="log", yscale="log", xlabel="new tokens in the pass (k)", ylabel="time / its round's roof, paired (95%)",
                    title="how far from what the machine allows")
        axes[2].axhline(1.0, color="grey", linewidth=0.5)
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=8)
    if drafters:  # one bar per drafter engine, beside the verifier's one-token pass for scale
        steps = axes[-1]
        names = [r["engine"] for r in drafters]
        steps.barh(names, [r["draft_step_ms"] for r in drafters], color="tab:grey")
        for name, color in colors.items():
            one = next(r["verify_ms"] for r in rows if r["engine"] == name and r["tokens"] == 1)
            steps.axvline(one, linestyle=":", color=color, label=f"{name}: T(1)")
        steps.invert_yaxis()
        steps.tick_params(axis="y", labelsize=8)
        steps.set(xlabel="one drafter step (ms, median)", title="drafter steps")
        steps.legend(fontsize=7)
    absolute.set(
        xscale="log", yscale="log", xlabel="new tokens in the pass (k)", ylabel="forward time (ms, median)",
        title=f"verifier forward after {rows[0]['context']} tokens",
    )
    relative.set(
        xscale="log", xlabel="new tokens in the pass (k)", ylabel="T(k) / T(1), paired (95%)", title="cost of verifying k tokens, relative"
    )
    relative.axhline(1.0, color="grey", linewidth=0.5)
    for ax in (absolute, relative):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
