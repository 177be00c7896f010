"""Hybrid drafting: n-gram candidates (prompt lookup or suffix, per request `tree.ngram`, else
the configured default) join any drafter's tree under the same node budget."""
from __future__ import annotations

from typing import Any

import torch

from drafter_service.drafting import Drafter, DrafterSession, ngram_draft
from specdec.core.batching import Job
from specdec.core.ngram import NgramProposer, merge_trees
from specdec.core.sampling import Sampling
from specdec.core.tree import TreeShape


class HybridDrafter(Drafter):
    """`inner` drafts alone where a request's tree.ngram (else `default`) is "none"."""

    def __init__(self, inner: Drafter, methods: dict[str, NgramProposer], default: str):
        self.inner, self.methods, self.default, self.info = inner, methods, default, inner.info

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        method = shape.ngram or self.default
        if method == "none":
            return (yield from self.inner.draft(session, context, shape, budget))
        # Greedy: the n-gram draft, then the inner drafter's nodes (at least one) fill the budget.
        # Sampling: a deterministic child cannot join children sampled from a proposal, so where
        # the context matched, the n-gram draft goes alone.
        greedy = session.sampling.greedy
        candidates = ngram_draft(session, self.methods[method], context, budget - 1 if greedy else budget, shape.max_depth)
        if not candidates:
            return (yield from self.inner.draft(session, context, shape, budget))
        if not greedy:
            return candidates.tree, candidates.confidence
        tree, _ = yield from self.inner.draft(session, context, shape, budget - len(candidates))
        return merge_trees(candidates.tree, tree, budget), []

    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> Job:
        return (yield from self.inner.pick(session, context, shape, excludes))

    def new_state(self, context: list[int], sampling: Sampling) -> Any:
        return self.inner.new_state(context, sampling)

    def state_bytes(self, state: Any) -> int:
        return self.inner.state_bytes(state)

    def begin_round(self, session: DrafterSession, steering: torch.Tensor | None) -> float:
        return self.inner.begin_round(session, steering)

    def end_round(self, session: DrafterSession) -> None:
        self.inner.end_round(session)

    def take_features(self, session: DrafterSession, start: int, rows: torch.Tensor) -> None:
        self.inner.take_features(session, start, rows)

    def forward_many(self, forwards: list) -> list:
        return self.inner.forward_many(forwards)
