"""`specdec bench --weight-quality`: what each weight format costs in quality. float32
transformers (for a GGUF verifier: the file's own weights, dequantized) continues each held-out
prompt greedily; each format then reads prompt and continuation in one teacher-forced pass, and
its next-token distribution at every continuation position is compared with float32's: top-1
agreement, and KL(float32 || format) in nats."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.core.engine import engine_for
from specdec.core.models import load_model


def run_weight_quality(config, prompt_ids: list[list[int]], formats: list[str], new_tokens: int) -> list[dict]:
    served = config.verifier.model
    reference = load_model(dataclasses.replace(served, dtype="float32"))
    texts = []  # (prompt, float32's greedy continuation, float32's log-probabilities there)
    with torch.inference_mode():
        for ids in tqdm(prompt_ids, desc="float32 continuations", unit="prompt"):
            out = reference.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            continuation = out[0, len(ids):].tolist()
            logits = reference(out).logits[0, len(ids) - 1 : -1].float()
            texts.append((ids, continuation, logits.log_softmax(-1)))
    del reference
    rows = []
    for asked in formats or [served.dtype]:
        model = load_model(dataclasses.replace(served, dtype=asked))
        dtype = model.weight_format  # dtype auto: the format it chose
        engine = engine_for(model, dtype)
        agree, divergence, positions = 0, 0.0, 0
        with torch.inference_mode():
            for ids, continuation, expected in tqdm(texts, desc=dtype, unit="prompt"):
                cache = engine.new_cache()
                engine(cache, ids[:-1], prefill=True)
                logits, _ = engine(cache, ids[-1:] + continuation[:-1], num_logits=len(continuation))
                mine = logits.float().log_softmax(-1)
                agree += int((mine.argmax(-1) == expected.argmax(-1)).sum())
                divergence += float((expected.exp() * (expected - mine)).sum())
                positions += len(continuation)
        rows.append({"format": dtype, "top1_agreement": agree / positions, "kl_nats": divergence / positions, "positions": positions,
                     "prompts": len(texts)})
    return rows


def format_quality(rows: list[dict]) -> str:
    lines = ["format | top-1 agreement with float32 | KL(float32 || format), nats | positions", "---|---|---|---"]
    lines += [f"{r['format']} | {r['top1_agreement']:.3f} | {r['kl_nats']:.4f} | {r['positions']}" for r in rows]
    return "\n".join(lines)


def plot_quality(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (agreement, divergence) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["format"] for r in rows]
    agreement.bar(names, [r["top1_agreement"] for r in rows])
    agreement.set(ylim=(0.8, 1.0), ylabel="top-1 agreement with float32", title="teacher-forced on float32's greedy text")
    divergence.bar(names, [r["kl_nats"] for r in rows], color="tab:orange")
    divergence.set(ylabel="KL(float32 || format), nats", title="mean over continuation positions")
    for ax in (agreement, divergence):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
