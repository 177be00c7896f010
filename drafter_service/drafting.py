"""The one interface every drafting method implements, as vLLM's proposers and transformers'
`CandidateGenerator` do: a session's own state, a token picked ahead, a tree drafted after a
context. The model drafter, the feature head, the n-gram drafters and the oracle are peers
behind it; hybrid drafting wraps any of them. The service (drafter_service/drafting_sessions.py)
does what is common to all: sessions, request checks, round numbers, committed tokens and their
n-gram index."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from specdec.core.batching import Job
from specdec.core.errors import RequestError
from specdec.core.grammar import GrammarState, Grammars
from specdec.core.ngram import NgramDraft, NgramIndex, NgramProposer
from specdec.core.sampling import Sampling
from specdec.core.tree import DraftTree, TreeShape

ANY_TOKEN = 2**31 - 1  # a drafter without a tokenizer takes any id: the verifier checks them


class ScoredTree(NamedTuple):
    """What a drafter's `draft` job returns."""

    tree: DraftTree
    confidence: list[float]  # per node, the chance the verifier accepts its path; [] = no estimate


@dataclass(kw_only=True)  # nine fields of one answer: named, so none can swap places
class Draft:
    """One Draft call's answer."""

    tree: DraftTree
    assumed: list[int]  # the assumed tokens and the drafter's pick after them (overlapped drafting)
    compute_ms: float
    steering_ms: float  # of compute_ms, turning the steering vector into deltas
    forward_passes: int
    confidence: list[float]  # per node, the chance the verifier accepts its path; [] = no estimate
    # Drafting across tokenizers (drafter_service/cross_tokenizer_drafter.py); 0 otherwise.
    own_tokens_drafted: int = 0  # tokens drafted in the drafter's own tokenizer
    reencode_rollbacks: int = 0  # times the drafter's last tokens changed as committed text arrived
    mapping_ms: float = 0.0  # of compute_ms, mapping between the tokenizers


@dataclass
class DrafterSession:
    """What the service keeps of every session, whatever drafts it; `state` is the drafter's own."""

    tokens: list[int]  # the committed context
    sampling: Sampling
    generator: torch.Generator
    ngram: NgramIndex  # the n-gram index of the committed tokens
    state: Any = None
    prompt_length: int = 0  # of tokens: the context it was opened with
    forward_passes: int = 0  # model forwards run for this session
    own_tokens_drafted: int = 0  # across tokenizers: the counters of Draft's fields of the same names
    reencode_rollbacks: int = 0
    mapping_ms: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The last n-gram draft and its proposer, which learns from the tokens committed after it.
    lesson: tuple[NgramProposer, NgramDraft] | None = None
    # The last call's round number and answer: a retried round gets the same answer again.
    last_round: int = 0
    last_draft: Draft | None = None
    # Structured outputs, where the drafter reads the verifier's tokens (Drafter.grammars): the
    # grammar after the committed context, and this round's states of the draft's nodes (ROOT:
    # after the drafting context); None = proposals unmasked (the coordinator prunes them).
    grammar: GrammarState | None = None
    draft_states: dict[int, GrammarState] | None = None


@dataclass(frozen=True)
class VerifierState:
    """Verifier state of positions start, start + 1, ...: `positions` records of equal size, as
    the verifier filled them (common.proto VerifierState); what they hold is the drafter's own."""

    start: int
    positions: int
    records: bytes


@dataclass
class DrafterInfo:
    """What a drafter reports (ModelInfo) and what the service checks requests against."""

    model: torch.nn.Module | None = None  # its config describes the drafter; None = no model
    vocab_size: int = ANY_TOKEN
    fingerprint: str = ""  # of its tokenizer; "" = it reads token ids only
    eos_ids: list[int] = field(default_factory=list)
    max_context: int = ANY_TOKEN
    kv_bytes_per_token: int = 0
    steering_size: int = 0  # SD²: the steering vector it reads; 0 = none
    steering_fingerprint: str = ""
    verifier_state: str = ""  # the verifier state it reads (common.proto VerifierState); "" = none
    weight_format: str = ""  # the format its weights are served in (dtype auto: the one chosen); "" = no model


class Drafter(ABC):
    """A drafting method. Its jobs (specdec/core/batching.py) yield the forwards they need and
    `forward_many` runs those of many sessions together; a drafter without a model yields none."""

    info: DrafterInfo
    # Compiles a request's constraint over this drafter's tokens, where they are the verifier's;
    # its proposals are then masked by it (grammar_masks). None = they are not.
    grammars: Grammars | None = None

    def new_state(self, context: list[int], sampling: Sampling) -> Any:
        """A new session's state of this drafter's own (its cache, say); None = it keeps none."""
        return None

    def check(self, shape: TreeShape) -> None:
        """Refuses (invalid) a plan this drafter cannot serve, before the round changes anything."""

    def begin_round(self, session: DrafterSession, steering: torch.Tensor | None) -> float:
        """Readies a round under a steering vector (SD²; None = unsteered); the ms that took."""
        return 0.0

    def end_round(self, session: DrafterSession) -> None:
        """The round is over, drafted or failed."""

    def take_verifier_state(self, session: DrafterSession, state: VerifierState) -> None:
        """The verifier state this drafter reads (info.verifier_state), as the verifier sent it."""
        raise RequestError("verifier_state was sent, but this drafter reads none")

    @abstractmethod
    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> Job:
        """Overlapped drafting: the job's value is this drafter's guess of the token after
        `context`, its likeliest outside `excludes`; None = it has none (then no draft)."""

    @abstractmethod
    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        """The job's value: a ScoredTree, a tree of at most `budget` nodes after `context`. `context`
        is the committed tokens and, in overlapped drafting, the assumed and picked ones after them."""

    def forward_many(self, forwards: list) -> list:
        """The forwards several sessions' jobs yielded, run together."""
        raise NotImplementedError(f"{type(self).__name__} runs no forwards")

    def state_bytes(self, state: Any) -> int:
        """Memory a session's state holds (counted against limits.max_kv_mib)."""
        return 0



class WrappedDrafter(Drafter):
    """A drafter around another (`inner`): every hook of the interface goes to `inner` unless
    the wrapper overrides it, so a wrapper cannot miss one (tests/test_ngram.py checks that
    each of Drafter's hooks is forwarded here)."""

    def __init__(self, inner: Drafter):
        self.inner, self.info, self.grammars = inner, inner.info, inner.grammars

    def new_state(self, context: list[int], sampling: Sampling) -> Any:
        return self.inner.new_state(context, sampling)

    def check(self, shape: TreeShape) -> None:
        self.inner.check(shape)

    def begin_round(self, session: DrafterSession, steering: torch.Tensor | None) -> float:
        return self.inner.begin_round(session, steering)

    def end_round(self, session: DrafterSession) -> None:
        self.inner.end_round(session)

    def take_verifier_state(self, session: DrafterSession, state: VerifierState) -> None:
        self.inner.take_verifier_state(session, state)

    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> Job:
        return (yield from self.inner.pick(session, context, shape, excludes))

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        return (yield from self.inner.draft(session, context, shape, budget))

    def forward_many(self, forwards: list) -> list:
        return self.inner.forward_many(forwards)

    def state_bytes(self, state: Any) -> int:
        return self.inner.state_bytes(state)

def ngram_draft(session: DrafterSession, proposer: NgramProposer, context: list[int], budget: int, max_depth: int) -> NgramDraft:
    """The proposer's draft after `context`; one made right after the committed tokens is kept,
    to learn from what gets committed next."""
    draft = proposer.propose(session.ngram, context, budget, max_depth)
    session.lesson = (proposer, draft) if draft.tree and len(context) == len(session.tokens) else None
    return draft


def grammar_masks(session: DrafterSession, tree: DraftTree, nodes: list[int]) -> list[torch.Tensor | None] | None:
    """For each of a builder's `nodes` (ROOT included), the tokens the request's constraint
    allows after its path, over the whole vocabulary (None: the path breaks the grammar, or the
    node is unknown); None without a constraint."""
    states = session.draft_states
    if states is None:
        return None
    for node in nodes:
        if node not in states and tree.parent[node] in states:
            child = states[tree.parent[node]].copy()
            if child.advance([tree.token_ids[node]]):
                states[node] = child
    return [states[node].allowed() if node in states else None for node in nodes]
