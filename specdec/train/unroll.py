"""The feature head trained as it drafts (training-time test, EAGLE-3 and HASS): the head is
unrolled `steps` steps. Step 1 reads the verifier's features. Step k reads, at position i, its
own step k-1 output of position i-1, and attends to step-1 entries up to i-k+1 plus its own
entries of steps 2..k on the diagonal: exactly what the k-th token of a live draft sees. Every
step is pulled toward the verifier's distribution at its position (cross-entropy on the draft
vocabulary).

Held-out prompts (never trained on) are evaluated the same way: greedy agreement and 1 - TVD at
T=1 by draft depth, and accepted tokens per chain round along the verifier's greedy text,
simulated exactly."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.feature_head import FeatureHead


@dataclass
class Sample:
    tokens: torch.Tensor  # (L,) prompt then continuation
    prompt_len: int
    hidden: torch.Tensor  # (L-1, 3, H) float16: the fused depths at positions 0..L-2
    target_ids: torch.Tensor  # (L-P, k) draft-vocabulary indices, positions P-1..L-2
    target_probs: torch.Tensor  # (L-P, k) float16


def _batch(samples: list[Sample], head: FeatureHead):
    """Right-padded ids (B, L), the previous position's fused feature (B, L, H) as it crosses
    the wire (float16), valid positions, and for each loss position (b, i) its target."""
    device = head.vocab_ids.device
    width = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long, device=device)
    previous = torch.zeros(len(samples), width, head.hidden_size, device=device)
    valid = torch.zeros(len(samples), width, dtype=torch.bool, device=device)
    rows, cols, target_ids, target_probs = [], [], [], []
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n], valid[b, :n] = s.tokens.to(device), True
        fused = head.fuse.fuse_depths(s.hidden.to(device).float()).half().float()
        previous[b, 1:n] = fused
        rows += [b] * (n - s.prompt_len)
        cols += list(range(s.prompt_len - 1, n - 1))
        target_ids.append(s.target_ids.to(device).long())
        target_probs.append(s.target_probs.to(device).float())
    probs = torch.cat(target_probs)
    where = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    # no draft-vocabulary mass: no pull
    return ids, previous, valid, where, torch.cat(target_ids), probs / probs.sum(-1, keepdim=True).clamp_min(1e-12)


def unrolled(head: FeatureHead, ids, previous, valid, steps: int, window: int) -> list[torch.Tensor]:
    """The head's outputs at each unrolled step: step 1 over all positions (B, L, H), steps
    2.. over positions [window, L) (B, L - window, H), each as a live draft would compute it."""
    batch, width = ids.shape
    device = ids.device
    positions = torch.arange(width, device=device)[None].expand(batch, -1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = (causal[None] & valid[:, None, :])[:, None]
    first, keys, values = head(ids, previous, positions, mask=mask)
    outputs, all_keys, all_values = [first], [keys], [values]
    rows = torch.arange(window, width, device=device)
    for k in range(2, steps + 1):
        before = outputs[-1] if k > 2 else first[:, window:]
        fed = torch.zeros_like(before)
        fed[:, 1:] = before[:, :-1]
        if k == 2 and window > 0:
            fed[:, 0] = first[:, window - 1]
        # Step-1 entries up to i-k+1, then this and earlier steps' entries on the diagonal.
        parts = [(torch.arange(width, device=device)[None] <= rows[:, None] - (k - 1))[None] & valid[:, None, :]]
        for s in range(2, k + 1):
            diagonal = (rows[None, :] == rows[:, None] - (k - s)).expand(batch, -1, -1)
            parts.append(diagonal)
        step_mask = torch.cat(parts, dim=2)[:, None]
        out, keys, values = head(
            ids[:, window:], fed, positions[:, window:], torch.cat(all_keys, dim=2), torch.cat(all_values, dim=2), step_mask
        )
        outputs.append(out)
        all_keys.append(keys)
        all_values.append(values)
    return outputs


def _step_logits(head: FeatureHead, outputs, window: int, where) -> list[torch.Tensor]:
    rows, cols = where
    picked = [outputs[0][rows, cols]] + [o[rows, cols - window] for o in outputs[1:]]
    return [head.logits(p) for p in picked]


def _window(samples: list[Sample], steps: int) -> int:
    return max(0, min(s.prompt_len for s in samples) - 1 - steps)


@torch.no_grad()
def evaluate(head: FeatureHead, samples: list[Sample], steps: int, batch: int = 4) -> dict:
    """Greedy agreement and 1 - TVD (T=1, against the verifier's top-k) by depth, and
    accepted tokens per chain-`steps` round along the verifier's greedy text."""
    agree, overlap, count = torch.zeros(steps), torch.zeros(steps), 0
    accepted: list[int] = []
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        ids, previous, valid, where, target_ids, target_probs = _batch(chunk, head)
        window = _window(chunk, steps)
        outputs = unrolled(head, ids, previous, valid, steps, window)
        logits = _step_logits(head, outputs, window, where)
        rows, cols = where
        truth = ids[rows, cols + 1]
        hits = []
        for k, step in enumerate(logits):
            q = step.float().softmax(-1)
            hit = head.vocab_ids[step.argmax(-1)] == truth
            hits.append(hit)
            agree[k] += hit.float().sum().item()
            overlap[k] += torch.minimum(q.gather(1, target_ids), target_probs).sum().item()
        count += len(rows)
        hits = [h.tolist() for h in hits]
        # hit[k][(b, i)]: step k+1 at position i predicts t_{i+1}; a round from bonus position n
        # drafts at n, n+1, ... with steps 1, 2, ...
        lookup = {(b, i): j for j, (b, i) in enumerate(zip(rows.tolist(), cols.tolist()))}
        for b, sample in enumerate(chunk):
            n, end = sample.prompt_len, len(sample.tokens) - 1
            while n < end:
                run = 0
                while run < steps and (b, n + run) in lookup and hits[run][lookup[(b, n + run)]]:
                    run += 1
                accepted.append(run)
                n += run + 1
    return {
        "greedy_agreement_by_depth": (agree / count).tolist(),
        "acceptance_t1_by_depth": (overlap / count).tolist(),
        f"accepted_per_chain{steps}_round": sum(accepted) / max(len(accepted), 1),
        "positions": count,
    }


def unrolled_loss(head: FeatureHead, samples: list[Sample], steps: int) -> torch.Tensor:
    """The cross-entropy of every unrolled step against the verifier's distribution, averaged."""
    ids, previous, valid, where, target_ids, target_probs = _batch(samples, head)
    window = _window(samples, steps)
    outputs = unrolled(head, ids, previous, valid, steps, window)
    losses = [
        -(target_probs * step.float().log_softmax(-1).gather(1, target_ids)).sum(-1).mean()
        for step in _step_logits(head, outputs, window, where)
    ]
    return torch.stack(losses).mean()
