"""The engine on a GPU, measured where Ray is not installed (a lent GPU machine): GEMM row
exactness by row count, k-token passes vs one-token steps for each row-bucket set, and the cost
curve (the same `time_engines` as `specdec bench --cost-curve`) of the bf16 engine with CUDA
graphs, eager, and float32 transformers, and of drafters' one-token steps.

    python scripts/gpu_engine.py --out OUT [--random CONFIG_DIR] [--drafters DIR,DIR] [--buckets "16;1,16,64"] [--repeats 12]

--random builds the verifier from a config.json with random weights (shapes decide kernels and
times; no weights needed; scripts/gpu_shapes holds the coder pair's and SmolLM2-135M's); without
it the default verifier is loaded. --drafters adds random-weight drafters of those shapes to the
cost curve (their one-token step, graphed and eager).
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoConfig

from specdec.bench import cost
from specdec.core.cuda_graphs import GraphRunner, row_buckets
from specdec.core.engine import ForwardCall, LlamaEngine, TransformersEngine
from specdec.core.tree import DraftTree, verification_inputs

TOKENS = [1, 2, 3, 5, 9, 17, 33]


def load(random_config: str | None, dtype: torch.dtype, device: str = "cuda"):
    if random_config:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(random_config)
        with torch.device(device):  # initialised where it runs: a 1.5B initialised on the CPU takes a minute
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), None
    from specdec.core.models import ModelSpec, load_model, load_tokenizer

    name = "smollm2-135m-instruct"
    spec = ModelSpec(name, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", device=device)
    return load_model(spec), load_tokenizer(name)


def context_ids(tokenizer, vocab: int, length: int) -> list[int]:
    if tokenizer is None:
        rng = random.Random(0)
        return [rng.randrange(vocab) for _ in range(length)]
    text = " ".join(["The history of the printing press shows how one invention changed the spread of ideas across Europe."] * 40)
    return tokenizer(text)["input_ids"][:length]


def gemm_rows(model) -> dict:
    """For each linear shape: do rows of an M-row product equal the same rows of a 64-row one, and
    row 0 the one-row product? (cuBLAS picks kernels by shape.)"""
    layer = model.model.layers[0]
    weights = {"q": layer.self_attn.q_proj.weight, "o": layer.self_attn.o_proj.weight, "gate": layer.mlp.gate_proj.weight,
               "down": layer.mlp.down_proj.weight, "lm_head": model.lm_head.weight}
    out = {}
    torch.manual_seed(1)
    with torch.inference_mode():
        for name, w in weights.items():
            x = torch.randn(128, w.shape[1], dtype=w.dtype, device=w.device)
            one = torch.nn.functional.linear(x[:1], w)
            ref = {m: torch.nn.functional.linear(x[:m], w) for m in (16, 64)}
            rows = {}
            for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33, 48, 64, 96, 128):
                y = torch.nn.functional.linear(x[:m], w)
                rows[m] = {"row0_eq_M1": bool(torch.equal(y[:1], one)),
                           "eq_M16": bool(torch.equal(y[: min(m, 16)], ref[16][: min(m, 16)])),
                           "eq_M64": bool(torch.equal(y[: min(m, 64)], ref[64][: min(m, 64)]))}
            out[name] = rows
    return out


def exactness(engine, context: list[int], continuation: list[int], starts=(200, 250)) -> dict:
    """max |logit difference| of a k-token pass against k one-token steps, k = 1..33, after
    `start` tokens (250: passes cross from the 256-position buffer to the 512 one)."""
    result = {}
    with torch.inference_mode():
        for start in starts:
            cache = engine.new_cache()
            engine(cache, context[:start], prefill=True)
            steps = torch.cat([engine(cache, [t])[0] for t in continuation[:33]])
            diffs = []
            for k in range(1, 34):
                cache.truncate(start)
                logits, _ = engine(cache, continuation[:k], num_logits=k)
                diffs.append(float((logits - steps[:k]).abs().max()))
            result[start] = diffs
    return result


def tree_exactness(engine, context: list[int], vocab: int) -> float:
    """A 33-node random tree (2 pending tokens) in one pass vs each node's path stepped."""
    rng = random.Random(7)
    parents = [-1] + [rng.randrange(-1, n) for n in range(1, 33)]
    tree = DraftTree([rng.randrange(vocab) for _ in parents], parents)
    worst = 0.0
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, context[:150], prefill=True)
        positions, mask = verification_inputs(tree, 150, 2)
        logits, _ = engine(cache, context[150:152] + tree.token_ids, len(tree) + 1, position_ids=positions, attention_mask=mask)
        for node in range(len(tree)):
            step = engine.new_cache()
            engine(step, context[:150], prefill=True)
            for t in context[150:152] + [tree.token_ids[n] for n in tree.path_to(node)]:
                last, _ = engine(step, [t])
            worst = max(worst, float((last[-1] - logits[node + 1]).abs().max()))
    return worst


def invariance(engine, context: list[int]) -> dict:
    """A prompt fed whole vs in parts; three sessions in one forward_many vs alone."""
    with torch.inference_mode():
        whole = engine.new_cache()
        logits, _ = engine(whole, context[:90], num_logits=5)
        parts = engine.new_cache()
        for a, b in [(0, 16), (16, 21), (21, 85)]:
            engine(parts, context[a:b])
        part_logits, _ = engine(parts, context[85:90], num_logits=5)
        split = bool(torch.equal(logits, part_logits) and torch.equal(whole.keys[:, :, :90], parts.keys[:, :, :90]))
        contexts = [context[:30], context[30:37], context[:64]]
        caches = [engine.new_cache() for _ in contexts]
        together = engine.forward_many([ForwardCall(c, ctx, 3) for c, ctx in zip(caches, contexts)])
        batched = all(torch.equal(got, engine(engine.new_cache(), ctx, 3)[0]) for ctx, (got, _) in zip(contexts, together))
    return {"prompt_in_parts_equal": split, "sessions_in_one_call_equal": batched}


def quick_times(engine, context: list[int], ks=(1, 2, 5, 9, 17, 33), repeats: int = 20) -> dict:
    times = {}
    with torch.inference_mode():
        cache = engine.new_cache()
        engine(cache, context[:200], prefill=True)
        for k in ks:
            samples = []
            for r in range(repeats + 3):
                cache.truncate(200)
                begin = time.perf_counter()
                engine(cache, context[200 - k : 200], num_logits=k)[0].cpu()
                if r >= 3:
                    samples.append((time.perf_counter() - begin) * 1e3)
            times[k] = statistics.median(samples)
    return times


def graphed(model, buckets: tuple[int, ...]) -> LlamaEngine:
    engine = LlamaEngine(model)
    engine.graphs = GraphRunner(engine, buckets)
    return engine


def section(report: dict, name: str, fn, out: Path):
    begin = time.perf_counter()
    try:
        report[name] = fn()
    except Exception:  # noqa: BLE001 - one section's failure must not lose the others
        report[name] = {"error": traceback.format_exc()}
    print(f"== {name} ({time.perf_counter() - begin:.1f} s): {json.dumps(report[name])[:3000]}", flush=True)
    (out / "gpu_engine.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--random", help="a directory with a config.json: random weights of that shape")
    parser.add_argument("--drafters", default="", help="comma-separated config directories: random-weight drafters timed too")
    parser.add_argument("--buckets", default="16;1,16,64;16,64", help="row-bucket sets to check, ';'-separated")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (the runner uncaptured)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(","))
    report: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__,
                    "cost_curve_buckets": list(row_buckets()), "weights": "random" if args.random else "smollm2-135m-instruct"}
    begin = time.perf_counter()
    model, tokenizer = load(args.random, torch.bfloat16, args.device)
    vocab = model.config.vocab_size
    drafters = [d for d in args.drafters.split(",") if d]
    # random ids every model can read: a drafter's vocabulary may be smaller than the verifier's
    context = context_ids(tokenizer, min([vocab] + [AutoConfig.from_pretrained(d).vocab_size for d in drafters]), 300)
    report["load_s"] = time.perf_counter() - begin
    with torch.inference_mode():  # the chain fed: the model's own greedy continuation, as accepted drafts are
        eager = LlamaEngine(model, cuda_graphs=False)
        cache = eager.new_cache()
        logits, _ = eager(cache, context[:250], prefill=True)
        continuation = []
        for _ in range(33):
            continuation.append(int(logits[-1].argmax()))
            logits, _ = eager(cache, continuation[-1:])
    if "gemm" not in skip:
        section(report, "gemm_rows", lambda: gemm_rows(model), out)
    if "exact" not in skip:
        section(report, "exact_eager", lambda: exactness(eager, context, continuation), out)
        for text in args.buckets.split(";"):
            buckets = tuple(int(b) for b in text.split(","))
            engine = graphed(model, buckets)
            name = "buckets_" + "_".join(map(str, buckets))
            section(report, f"exact_{name}", lambda: exactness(engine, context, continuation), out)
            section(report, f"tree_{name}", lambda: tree_exactness(engine, context, vocab), out)
            section(report, f"invariance_{name}", lambda: invariance(engine, context), out)
            section(report, f"times_{name}", lambda: quick_times(engine, context), out)
            section(report, f"graphs_{name}", lambda: sorted(map(list, engine.graphs.graphs)), out)
            del engine
    if "cost" not in skip:
        def curve():
            engines = {
                "bf16 engine, CUDA graphs": ("verifier", graphed(model, row_buckets())),
                "bf16 engine, eager": ("verifier", LlamaEngine(model, cuda_graphs=False)),
            }
            fp32 = copy.deepcopy(model).float() if args.random else load(None, torch.float32, args.device)[0]
            engines["float32 transformers verifier"] = ("verifier", TransformersEngine(fp32))
            for shape in drafters:
                drafter = load(shape, torch.bfloat16, args.device)[0]
                name = Path(shape).name
                engines[f"{name} drafter, CUDA graphs"] = ("drafter", graphed(drafter, row_buckets()))
                engines[f"{name} drafter, eager"] = ("drafter", LlamaEngine(drafter, cuda_graphs=False))
            rows = cost.time_engines(engines, context[:200], TOKENS, repeats=args.repeats)
            (out / "cost_curve.json").write_text(json.dumps(rows, indent=1))
            cost.plot_cost_curve(rows, out / "cost_curve.png")
            print(cost.format_cost_curve(rows), flush=True)
            return rows
        section(report, "cost_curve", curve, out)


if __name__ == "__main__":
    main()
