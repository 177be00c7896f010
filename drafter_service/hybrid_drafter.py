"""Hybrid drafting: n-gram candidates (prompt lookup or suffix, per request `tree.ngram`, else
the configured default) join any drafter's tree under the same node budget, or (`fallback`) go
alone where the context matches, the drafter drafting only where it does not."""
from __future__ import annotations

from drafter_service.drafting import Drafter, DrafterSession, ScoredTree, WrappedDrafter, ngram_draft
from specdec.core.batching import Job
from specdec.core.ngram import NgramProposer, merge_trees
from specdec.core.tree import TreeShape


class HybridDrafter(WrappedDrafter):
    """`inner` drafts alone where a request's tree.ngram (else `default`) is "none"."""

    def __init__(self, inner: Drafter, methods: dict[str, NgramProposer], default: str, fallback: bool = False):
        super().__init__(inner)
        self.methods, self.default, self.fallback = methods, default, fallback

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        method = shape.ngram or self.default
        if method == "none":
            return (yield from self.inner.draft(session, context, shape, budget))
        # Greedy: the n-gram draft, then the inner drafter's nodes (at least one) fill the budget.
        # Sampling: a deterministic child cannot join children sampled from a proposal, so where
        # the context matched, the n-gram draft goes alone.
        merged = session.sampling.greedy and not self.fallback
        candidates = ngram_draft(session, self.methods[method], context, budget - 1 if merged else budget, shape.max_depth)
        if not candidates:
            return (yield from self.inner.draft(session, context, shape, budget))
        if not merged:
            return ScoredTree(candidates.tree, candidates.confidence)
        tree = (yield from self.inner.draft(session, context, shape, budget - len(candidates))).tree
        return ScoredTree(merge_trees(candidates.tree, tree, budget), [])
