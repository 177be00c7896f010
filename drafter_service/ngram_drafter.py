"""The drafter without a model (specdec/core/ngram.py): prompt lookup or suffix decoding, with
the same sessions, checks and API as the model drafter. It reads token ids only, so it pairs
with any verifier's tokenizer."""
from __future__ import annotations

import torch

from drafter_service.drafter import DrafterEngine, DrafterSession
from specdec.core.batching import Job
from specdec.core.models import ModelSpec
from specdec.core.ngram import NgramProposer
from specdec.core.tree import DraftTree, TreeShape
from specdec.serving.rpc import invalid

ANY_TOKEN = 2**31 - 1  # token ids are checked by the verifier, which knows its vocabulary


class NgramDrafter(DrafterEngine):
    def __init__(self, spec: ModelSpec, *args, **options):
        super().__init__(spec, *args, **options)
        self.default_ngram = spec.source

    def _load_tokenizer(self, spec: ModelSpec) -> None:
        self.tokenizer, self.vocab_size, self.fingerprint = None, ANY_TOKEN, ""

    def _kv_bytes_per_token(self) -> int:
        return 0

    def _load(self, spec: ModelSpec, steering_checkpoint: str | None) -> None:
        if steering_checkpoint:
            raise ValueError(f"the '{spec.source}' drafter has no model to steer; it takes no steering checkpoint")
        self.model = self.engine = None
        self.eos_ids, self.max_context, self.steering_size = [], ANY_TOKEN, 0

    def _new_cache(self) -> None:
        return None

    def _proposer(self, shape: TreeShape) -> NgramProposer:
        proposer = super()._proposer(shape)
        if proposer is None:
            raise invalid("tree.ngram none asks for a drafter model's drafts; this drafter has no model (it drafts n-grams only)")
        return proposer

    def _draft_after(
        self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int, pick: bool, pick_excludes: list[int],
        steering: torch.Tensor | None,
    ) -> Job:
        yield from ()  # a job that runs no forward
        proposer = self._proposer(shape)
        if pick:  # overlapped drafting: its pick is the first token of its draft, if it has one
            first = proposer.propose(session.ngram, context, 1 + len(pick_excludes), 1).tree
            options = [t for t in first.token_ids if t not in pick_excludes]
            if not options:
                return DraftTree(), 0.0, []
            context.append(options[0])
        draft = self._ngram_draft(session, proposer, context, budget, shape.max_depth, pick)
        return draft.tree, 0.0, draft.confidence
