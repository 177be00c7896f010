"""What a drafter with a model makes of its logits: the distributions tree builders expand,
the sparse proposal a sampled node carries to the verifier, and a picked token. Logits are over
the draft vocabulary (`draft_vocab`: the ids a reduced-vocabulary head proposes), else over all."""
from __future__ import annotations

import torch

from drafter_service.tree_builders import NextToken
from specdec.core.grammar import mask_rows
from specdec.core.sampling import Sampling, greedy_tokens, warp_probs
from specdec.core.tree import Proposal


def next_tokens(
    logits: torch.Tensor, sampling: Sampling, draft_vocab: torch.Tensor | None, proposal_top_k: int,
    allowed: list[torch.Tensor | None] | None = None,
) -> list[NextToken]:
    """The distribution after each of several nodes, from their logits (rows); with `allowed`
    (a constraint's tokens after each node, over the whole vocabulary), on those alone, where
    the drafter's vocabulary holds any of them."""
    if allowed is not None:
        logits = logits.clone()
        for row, mask in enumerate(allowed):
            mask = mask if mask is None or draft_vocab is None else mask[draft_vocab]
            if mask is not None and mask.any():
                logits[row] = mask_rows(logits[row], mask)
    if sampling.greedy:
        return [NextToken(probs, draft_vocab) for probs in torch.softmax(logits.double(), dim=-1)]
    proposals = [sparse_proposal(row, sampling, draft_vocab, proposal_top_k) for row in logits]
    return [NextToken(torch.tensor(p.probs, dtype=torch.float64), torch.tensor(p.token_ids), p) for p in proposals]


def sparse_proposal(logits: torch.Tensor, sampling: Sampling, draft_vocab: torch.Tensor | None, top_k: int) -> Proposal:
    """The sparse distribution the next token is drawn from, exactly as the verifier will
    rebuild it from the float32 wire values."""
    probs = warp_probs(logits, sampling)
    top = torch.topk(probs, min(top_k, probs.shape[-1]))
    keep = top.values > 0
    values = top.values[keep]
    tokens = top.indices[keep] if draft_vocab is None else draft_vocab[top.indices[keep]]
    return Proposal(tokens.tolist(), (values / values.sum()).float().tolist())


def likeliest(logits: torch.Tensor, draft_vocab: torch.Tensor | None, excludes: list[int]) -> int:
    """The likeliest token of one row of logits outside `excludes`."""
    logits = logits.clone()
    vocab = torch.arange(len(logits)) if draft_vocab is None else draft_vocab
    logits[torch.isin(vocab, torch.tensor(list(excludes), dtype=torch.long))] = float("-inf")
    return int(vocab[greedy_tokens(logits)[0]])
