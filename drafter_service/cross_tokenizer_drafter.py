"""Drafting with a model of another tokenizer (`drafter.tokenizer: own`): any drafter of its own
tokens, wrapped so that the wire speaks the verifier's. The coordinator and the verifier see a
drafter like any other; the mapping (drafter_service/tokenizer_bridge.py) lives here alone."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from drafter_service.drafting import Drafter, DrafterSession, ScoredTree, WrappedDrafter
from drafter_service.tokenizer_bridge import FollowedText, TokenizerBridge, common_prefix
from specdec.core.batching import Job
from specdec.core.models import tokenizer_fingerprint
from specdec.core.ngram import NgramIndex
from specdec.core.sampling import Sampling
from specdec.core.tree import TreeShape


@dataclass
class CrossState:
    text: FollowedText
    own: DrafterSession  # the inner drafter's session, in its own tokens


class CrossTokenizerDrafter(WrappedDrafter):
    """`inner` drafts in `own` tokens; requests and drafts carry `verifier` tokens. Its budget
    in own tokens follows the verifier tokens an own token has become so far (EMA), so that a
    draft fills the verifier's node budget."""

    def __init__(self, inner: Drafter, bridge: TokenizerBridge, max_ngram: int, cap: int):
        super().__init__(inner)
        self.bridge, self.max_ngram, self.cap = bridge, max_ngram, cap
        self.grammars = None  # its model's tokens are not the verifier's: the coordinator prunes its drafts
        self.info = dataclasses.replace(
            inner.info, vocab_size=len(bridge.verifier), fingerprint=tokenizer_fingerprint(bridge.verifier),
            eos_ids=sorted({bridge.verifier.eos_token_id} - {None}),
        )
        self.verifier_per_own = 1.0

    def new_state(self, context: list[int], sampling: Sampling) -> CrossState:
        text = FollowedText()
        own = list(self.bridge.follow(text, context))
        session = DrafterSession(
            own, sampling, torch.Generator(), NgramIndex(self.max_ngram, own), self.inner.new_state(own, sampling), prompt_length=len(own),
        )
        return CrossState(text, session)

    def state_bytes(self, state: CrossState) -> int:
        return self.inner.state_bytes(state.own.state)

    def begin_round(self, session: DrafterSession, steering: torch.Tensor | None) -> float:
        return self.inner.begin_round(session.state.own, steering)

    def end_round(self, session: DrafterSession) -> None:
        self.inner.end_round(session.state.own)

    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> Job:
        """No guess of a single verifier token ahead: overlapped rounds draft nothing here."""
        return None
        yield  # a job that asks for no forward

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        state: CrossState = session.state
        start, rollbacks = time.perf_counter(), state.text.rollbacks
        own, inner = self._follow(state, context), state.own
        mapping_ms = (time.perf_counter() - start) * 1e3
        inner.generator = session.generator
        passes = inner.forward_passes
        # A draft's last verifier token is dropped (it may be cut mid-word): one more is drafted.
        own_budget = min(self.cap, max(1, math.ceil((budget + 1) / self.verifier_per_own)))
        # Depth in own tokens says little of depth in the verifier's: the node budget bounds both.
        tree = (yield from self.inner.draft(inner, own, dataclasses.replace(shape, max_depth=0), own_budget)).tree
        start = time.perf_counter()
        mapped, unbounded = self.bridge.to_verifier(state.text, tree, budget)
        session.mapping_ms += mapping_ms + (time.perf_counter() - start) * 1e3
        session.forward_passes += inner.forward_passes - passes
        session.own_tokens_drafted += len(tree)
        session.reencode_rollbacks += state.text.rollbacks - rollbacks
        if tree:
            self.verifier_per_own = 0.9 * self.verifier_per_own + 0.1 * max(unbounded, 1) / len(tree)
        return ScoredTree(mapped, [])

    def _follow(self, state: CrossState, context: list[int]) -> list[int]:
        """The inner session brought to `context` in own tokens (its n-gram index too)."""
        own, inner = list(self.bridge.follow(state.text, context)), state.own
        keep = common_prefix(inner.tokens, own)
        if keep < len(inner.tokens):
            inner.ngram = NgramIndex(self.max_ngram, own[:keep])
        inner.ngram.extend(own[keep:])
        inner.tokens = own
        return list(own)
