"""Samples a drafter learns from: batched continuations of prompts (teacher or student,
sampled at T=1 or greedy), the padded batches they train in, and the draft vocabulary they
suggest."""
from __future__ import annotations

from collections import Counter

import torch
from tqdm import tqdm
from transformers import DynamicCache

Sample = tuple[list[int], list[int]]  # (prompt ids, continuation ids)


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def sample_continuations(
    model, prompts: list[list[int]], max_new: int, eos: set[int], pad: int, generator: torch.Generator,
    greedy: bool = False, vocab_ids: torch.Tensor | None = None,
) -> list[list[int]]:
    """Batched sampling at T=1 (or greedy) with a KV cache. Works for students whose head
    covers only vocab_ids."""
    ids, mask = _left_pad(prompts, pad)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    steps = []
    for _ in range(max_new):
        logits = out.logits[:, -1].float()
        index = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        tokens = index if vocab_ids is None else vocab_ids[index]
        steps.append(tokens)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
    generated = torch.stack(steps, dim=1).tolist()
    return [_cut_at_eos(g, eos) for g in generated]


def generate_samples(model, tokenizer, prompts, per_prompt, cfg, eos, generator, desc, greedy=False, vocab_ids=None) -> list[Sample]:
    jobs = [p for p in prompts for _ in range(per_prompt)]
    samples: list[Sample] = []
    for start in tqdm(range(0, len(jobs), cfg.generation_batch), desc=desc, unit="batch"):
        batch = jobs[start : start + cfg.generation_batch]
        outs = sample_continuations(
            model, batch, cfg.sample_tokens if not greedy else cfg.eval_tokens, eos, tokenizer.pad_token_id or 0, generator, greedy,
            vocab_ids,
        )
        samples += [(p, o) for p, o in zip(batch, outs) if o]
    return samples


def batch_tensors(samples: list[Sample], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and the mask of positions whose next token is a
    continuation token (where a drafter drafts)."""
    seqs = [p + c for p, c in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    loss_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (p, c) in enumerate(samples):
        loss_mask[row, len(p) - 1 : len(p) + len(c) - 1] = True
    return ids, mask, loss_mask


def draft_vocab(samples: list[Sample], size: int, must_have: set[int]) -> list[int] | None:
    if size <= 0:
        return None
    counts = Counter(t for p, c in samples for t in p + c)
    chosen = set(must_have) | {t for t, _ in counts.most_common(size)}
    return sorted(chosen)[: max(size, len(must_have))] if len(chosen) > size else sorted(chosen)
