"""`specdec bench`: speed measured side by side in one run on the same prompts
(specdec/bench/speed.py), or one of the studies a flag asks for: the verifier's cost curve,
the weight formats' quality, the steering ablation, many sessions at once, the network sweep. Each writes JSON and plots
and prints its tables."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.bench.setup import BenchSetup, bench_setup
from specdec.core.prompts import PACKAGED_PROMPTS
from specdec.core.tree import TREE_METHODS
from specdec.serving.cli_args import add_tree_arguments


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts",
        default=str(PACKAGED_PROMPTS),
        help="Spec-Bench style JSONL (first turn is the prompt), or 'humaneval' (its 164 problems, each asked for as a completion "
        "of the function), 'humaneval-fresh' (asked for the body alone), 'code-edit' (their reference functions, each to be "
        "rewritten) or 'json' (each function described as JSON under a schema: every service row constrained by it, beside "
        "the verifier alone unconstrained); only held-out questions "
        "(id %% 4 == 0, never trained on) are used, round-robin across categories",
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--categories", help="comma-separated Spec-Bench categories (default: all)")
    parser.add_argument("--skip-prompts", type=int, default=0, help="skip this many held-out prompts first")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,1")
    parser.add_argument("--budgets", default="2,4", help="comma-separated draft tree nodes per round for `speculative`")
    parser.add_argument("--trees", default="chain", help=f"comma-separated tree methods for `speculative` ({', '.join(TREE_METHODS)})")
    parser.add_argument(
        "--drafters",
        help="comma-separated drafters compared side by side, each in its own stack (default: the config's): a model "
        "name or directory, 'model' (the config's drafter), 'prompt-lookup' or 'suffix' (no model), 'hybrid' (the config's "
        "drafter with n-gram candidates: its drafter.ngram.method, else suffix), 'fallback' (the same, the n-gram draft alone "
        "where the context matches and the model only where it does not), 'staged' (the config's drafter drafting "
        "with an n-gram second stage), 'oracle' (drafts the verifier alone's own greedy continuation of each prompt, "
        "recorded first through the same stack: the most any drafter could keep with each plan); NAME:unsteered runs a "
        "steered drafter without its steering; NAME@N@FORMAT a drafter model with its head cut to its N most frequent tokens "
        "(drafter.model.draft_vocab) and in the weight format FORMAT (a block format quantizes a GGUF's weights again), "
        "each optional: model@32768, model@32768@q4_0. With an n-gram drafter the run adds an `hf_prompt_lookup` row",
    )
    parser.add_argument(
        "--adaptive", action="store_true",
        help="add an `adaptive` row: the cost-model controller picks each round's plan (after one untimed warm-up request in which "
        "it measures every plan)",
    )
    parser.add_argument(
        "--hf-assistant",
        help="the drafter of `hf_assisted` (default: the config's drafter, or the built-in distilled drafter where that one is a "
        "feature head)",
    )
    add_tree_arguments(parser, with_method=False)
    parser.add_argument(
        "--placements",
        help="comma-separated verifier placements, each drafter measured in a stack of each (default: the config's): "
        "split (the verifier a deployment of its own: a round crosses two links), colocated (the verifier inside the "
        "coordinator, coordinator.verifier_in_process: one link); with two, rows are named PLACEMENT/NAME and each is "
        "compared with the verifier alone in its own placement",
    )
    parser.add_argument(
        "--verifier-formats",
        help="comma-separated weight formats of the verifier (int8, q4_1, ...), each in a stack of its own (default: the "
        "config's); with two, rows are named FORMAT/NAME and each is compared with the verifier alone in its own format",
    )
    parser.add_argument(
        "--in-process", action=argparse.BooleanOptionalAction, default=True,
        help="the rows run in the bench's own process (hf_assisted, hf_generate, hf_generate_fp32, hf_prompt_lookup): "
        "--no-in-process leaves them out (a 1.5B verifier's float32 generate() takes minutes a prompt)",
    )
    parser.add_argument(
        "--llama-cpp",
        help="comma-separated llama.cpp rows on the verifier's GGUF file (binaries built by scripts/build_llama_cpp.sh): none "
        "(plain decoding, llama-completion), or llama-speculative-simple with draft-simple[:N[:P_MIN]] (--llama-cpp-draft "
        "drafting up to N tokens a round), ngram-simple, ngram-map-k, ngram-mod or ngram-cache; e.g. none,draft-simple:3,ngram-mod",
    )
    parser.add_argument("--llama-cpp-draft", help="the draft model of the draft-simple rows: a GGUF source of the verifier's vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", help="YAML config for the stack (models, placement, speculation)")
    parser.add_argument("--port", type=int, default=50061, help="client port of the stack the bench starts")
    parser.add_argument("--address", help="benchmark an already running stack at host:port instead")
    parser.add_argument("--out", default="bench_results/bench.json", help="JSON output; the plot goes beside it")
    cost = parser.add_argument_group("engine cost curve (instead of the method comparison)")
    cost.add_argument(
        "--cost-curve", help="comma-separated new-token counts k, e.g. 1,2,3,5,9,17,33: forward time for k tokens after a committed context"
    )
    cost.add_argument("--cost-context", type=int, default=200, help="committed context length (tokens of the held-out prompts)")
    cost.add_argument(
        "--roofline", action="store_true",
        help="measure the memory bandwidth and each verifier format's multiply-add peak after every round, set each pass "
        "against its round's roof, max(bytes / bandwidth, k x multiply-adds / peak), and draw the roof beside each curve",
    )
    cost.add_argument(
        "--weight-formats",
        help="comma-separated weight formats of the verifier, a row each in the cost curve or the quality study (default: the served one)",
    )
    quality = parser.add_argument_group("weight-format quality (instead of the method comparison)")
    quality.add_argument(
        "--weight-quality", action="store_true",
        help="each of --weight-formats against float32 transformers, teacher-forced on float32's greedy continuation of each prompt: "
        "top-1 agreement and KL(float32 || format)",
    )
    network = parser.add_argument_group("network sweep (instead of the method comparison)")
    network.add_argument("--rtt-sweep", help="comma-separated round-trip times in ms to inject on both service links, e.g. 0,5,20,50,100")
    network.add_argument("--sweep-chains", default="1,2,4,8", help="fixed chain budgets of the sweep (also the adaptive candidates)")
    network.add_argument("--sweep-trees", default="16,32", help="fixed tree budgets of the sweep (also the adaptive candidates)")
    network.add_argument(
        "--sweep-overlap-chains", default="4",
        help="fixed chain budgets also run with overlapped drafting, to show what overlap hides where speculation runs ('' = none)",
    )
    network.add_argument("--jitter-ms", type=float, default=0.0, help="standard deviation of each direction's delay")
    network.add_argument("--bandwidth-mbps", type=float, default=0.0, help="bandwidth cap per direction; 0 = none")
    load = parser.add_argument_group("many streams at once (instead of the method comparison; first of --trees and --budgets)")
    load.add_argument("--concurrency", help="comma-separated numbers of concurrent streams, e.g. 1,4,8,16,32")
    load.add_argument(
        "--concurrency-repeats", type=int, default=2,
        help="bursts per policy and level, the policies taking turns in each of their orders (6 visit all)",
    )
    steering = parser.add_argument_group("SD² steering ablation (instead of the method comparison; first of --trees and --budgets)")
    steering.add_argument(
        "--steering-ablation", action="store_true", help="steered vs the same drafter unsteered vs the distilled-only drafter"
    )
    steering.add_argument("--steered-drafter", help="drafter checkpoint with steering (default: the config's drafter)")
    steering.add_argument("--distilled-drafter", help="drafter distilled with the same recipe and budget, without steering")
    steering.add_argument(
        "--ood-categories", help="comma-separated categories measured apart (default: those the steered drafter's recipe excluded)"
    )


def run_bench(args) -> int:
    setup = bench_setup(args)
    study = _study(args, setup)
    if study is None:
        from specdec.bench.speed import run_speed

        return run_speed(args, setup)
    run, plot, show, fields = study
    report = run()
    report["config"] = {**setup.described(args.max_new_tokens), **fields}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    print(show(report))
    print(f"wrote {out}, {out.with_suffix('.png')}")
    return 0


def _study(args, setup: BenchSetup):
    """The study a flag asks for, as (run() -> report, plot(report, path of the plot),
    format(report) -> tables, its own config fields); None = the speed comparison. The report
    goes to --out as JSON, its plot beside it."""
    config, budget, tree = setup.config, setup.budgets[0], setup.trees[0]
    formats = args.weight_formats.split(",") if args.weight_formats else []
    if args.cost_curve:
        from specdec.bench import cost

        context = ([t for ids in setup.prompt_ids for t in ids] * args.cost_context)[: args.cost_context]
        tokens = [int(k) for k in args.cost_curve.split(",")]
        return (lambda: cost.run_cost_curve(config, context, tokens, formats, with_roofline=args.roofline),
                lambda report, path: cost.plot_cost_curve(report["results"], path),
                lambda report: cost.format_cost_curve(report["results"]),
                {"cost_context": args.cost_context, "question_ids": setup.question_ids()})
    if args.weight_quality:
        from specdec.bench import quality

        return (lambda: {"results": quality.run_weight_quality(config, setup.prompt_ids, formats, args.max_new_tokens)},
                lambda report, path: quality.plot_quality(report["results"], path),
                lambda report: quality.format_quality(report["results"]), {"question_ids": setup.question_ids()})
    if args.steering_ablation:
        from specdec.bench import steering_ablation

        return (lambda: steering_ablation.run_steering_ablation(args, config, setup.app_args, setup.tokenizer, setup.shapes[tree], budget),
                steering_ablation.plot_ablation, steering_ablation.format_ablation, {})
    if args.concurrency:
        from specdec.bench import concurrency

        return (lambda: concurrency.run_concurrency(args, config, setup.prompt_ids, setup.app_args, tree, budget),
                concurrency.plot_concurrency, concurrency.format_concurrency,
                {"prefix_cache_mib": config.verifier.prefix_cache_mib, "question_ids": setup.question_ids()})
    if args.rtt_sweep:
        from specdec.bench import network

        return (lambda: network.run_rtt_sweep(args, config, setup.prompt_ids, setup.app_args, setup.placements),
                network.plot_sweep, network.format_sweep,
                {"prefix_cache_mib": 0, "jitter_ms": args.jitter_ms, "bandwidth_mbps": args.bandwidth_mbps,
                 "question_ids": setup.question_ids()})
    return None
