"""The drafter without a model (specdec/core/ngram.py): prompt lookup or suffix decoding. It
reads token ids only, so it pairs with any verifier's tokenizer."""
from __future__ import annotations

from drafter_service.drafting import Drafter, DrafterInfo, DrafterSession, ScoredTree, ngram_draft
from specdec.core.batching import forwardless
from specdec.core.ngram import NgramProposer
from specdec.core.tree import TreeShape
from specdec.core.errors import RequestError


class NgramDrafter(Drafter):
    """`methods`: the n-gram proposers; a request's tree.ngram picks one, else `default`."""

    def __init__(self, methods: dict[str, NgramProposer], default: str):
        self.methods, self.default, self.info = methods, default, DrafterInfo()

    def check(self, shape: TreeShape) -> None:
        if shape.ngram == "none":
            raise RequestError("tree.ngram none asks for a drafter model's drafts; this drafter has no model (it drafts n-grams only)")

    def _method(self, shape: TreeShape) -> NgramProposer:
        return self.methods[shape.ngram or self.default]

    @forwardless
    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> int | None:
        first = self._method(shape).propose(session.ngram, context, 1 + len(excludes), 1).tree  # the first tokens of its draft
        return next((t for t in first.token_ids if t not in excludes), None)

    @forwardless
    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> ScoredTree:
        draft = ngram_draft(session, self._method(shape), context, budget, shape.max_depth)
        return ScoredTree(draft.tree, draft.confidence)
