"""The drafter's model-side logic: sessions with a KV cache that follows the committed
context, and draft proposals (greedy picks, or samples with their sparse proposal),
optionally steered by the verifier's SD² vector."""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from drafter_service.tree_builders import NextToken, builder_for
from specdec.core.batching import Job, run_alone
from specdec.core.engine import ForwardCall, LlamaEngine, engine_for
from specdec.core.kv_cache import KVCache, TransformersCache
from specdec.core.models import (
    ModelSpec,
    check_tree_attention,
    eos_token_ids,
    load_model,
    load_tokenizer,
    max_context,
    tokenizer_fingerprint,
)
from specdec.core.ngram import (
    NgramDraft,
    NgramIndex,
    NgramLM,
    NgramProposer,
    NgramSettings,
    OwnChoices,
    merge_trees,
)
from specdec.core.sampling import Sampling, greedy_tokens, warp_probs
from specdec.core.steering import load_drafter_steering
from specdec.core.tree import (
    NGRAM_METHODS,
    ROOT,
    DraftTree,
    Proposal,
    TreeShape,
    node_inputs,
    verification_inputs,
)
from specdec.serving.config import LimitsConfig
from specdec.serving.rpc import ServiceError, invalid
from specdec.serving.sessions import SessionStore, check_context, check_kv_room


@dataclass
class DrafterSession:
    tokens: list[int]  # the committed context
    sampling: Sampling
    generator: torch.Generator
    cache: KVCache | TransformersCache
    # The cache holds cached_tokens (committed) and then the nodes of fed_tree, in node order:
    # the last draft's expanded nodes and the second stage's guesses.
    cached_tokens: list[int] = field(default_factory=list)
    fed_tree: DraftTree = field(default_factory=DraftTree)
    # Staged speculation: the fed nodes the tree builder expanded (the rest were guesses), and
    # whether that call was steered. A steering vector changes what a node's cache holds, so
    # across steered calls only what the drafter alone would have fed is reused.
    fed_expanded: set[int] = field(default_factory=set)
    fed_steered: bool = False
    reuse_guesses: bool = True  # this call may reuse guessed nodes
    lock: threading.Lock = field(default_factory=threading.Lock)
    prompt_length: int = 0  # of tokens: the context it was opened with
    ngram: NgramIndex | None = None  # the n-gram index of the committed tokens
    own: OwnChoices | None = None  # staged speculation: the drafter's own choices so far
    forward_passes: int = 0  # model forwards run for this session
    # The last n-gram draft and its proposer, which learns from the tokens committed after it.
    lesson: tuple[NgramProposer, NgramDraft] | None = None
    # The last call's round number and answer: a retried round gets the same answer again.
    last_round: int = 0
    last_draft: "Draft | None" = None
    deltas: list[torch.Tensor] | None = None  # the running draft's SD² steering, per layer


@dataclass
class DraftForward:
    """A forward a draft job asks for: the engine's call, and the SD² steering every token it
    feeds gets (None = unsteered). Steered forwards run alone: steering is the model's state."""

    call: ForwardCall
    deltas: list[torch.Tensor] | None = None


@dataclass
class Draft:
    """One Draft call's answer."""

    tree: DraftTree
    assumed: list[int]  # the assumed tokens and the drafter's pick after them (overlapped drafting)
    compute_ms: float
    steering_ms: float  # of compute_ms, turning the steering vector into deltas
    forward_passes: int
    confidence: list[float]  # per node, the chance the verifier accepts its path; [] = no estimate


class DrafterEngine:
    session_type = DrafterSession
    draft_vocab: torch.Tensor | None = None  # the token ids a reduced-vocabulary head can propose; None = all
    def __init__(
        self,
        spec: ModelSpec,
        proposal_top_k: int = 32,
        steering_checkpoint: str | None = None,
        ngram: NgramSettings | None = None,
        staged_lookahead: int = 0,
        limits: LimitsConfig = LimitsConfig(),
    ):
        self.spec = spec
        self._load_tokenizer(spec)
        self.proposal_top_k = proposal_top_k
        self.limits = limits
        self.sessions: SessionStore[DrafterSession] = SessionStore.of_caches(limits)
        self.steering, self.steering_fingerprint = None, ""
        self.feature_size, self.feature_fingerprint = 0, ""  # a drafter that reads verifier features sets them
        # n-gram candidates (per request, tree.ngram; by default drafter.ngram.method) join the
        # model's draft under the same node budget: hybrid drafts.
        settings = ngram or NgramSettings()
        self.proposers = {method: NgramProposer(method, settings) for method in NGRAM_METHODS}
        self.default_ngram = settings.method or "none"
        # Staged speculation: an n-gram stage guesses the drafter's next tokens, which it checks
        # in the forward it runs anyway; right guesses save forwards, the draft is unchanged.
        self.lookahead = staged_lookahead
        self.stage2 = self.proposers[settings.method or "prompt-lookup"] if staged_lookahead else None
        memory = settings.recent_output_tokens * len(OwnChoices.ORDERS)
        self.shared_choices = OwnChoices(memory) if staged_lookahead and memory else None  # None: each session its own
        self._load(spec, steering_checkpoint)
        self.kv_bytes_per_token = self._kv_bytes_per_token()

    def _kv_bytes_per_token(self) -> int:
        return self.engine.kv_bytes_per_token

    def _load_tokenizer(self, spec: ModelSpec) -> None:
        self.tokenizer = load_tokenizer(spec.source)
        self.vocab_size = len(self.tokenizer)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)

    def _load(self, spec: ModelSpec, steering_checkpoint: str | None) -> None:
        self.model = load_model(spec)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.max_context = max_context(self.model)
        if steering_checkpoint:
            self.steering, self.steering_fingerprint = load_drafter_steering(steering_checkpoint, self.model)
        self.steering_size = self.steering.norm.normalized_shape[0] if self.steering else 0
        self.draft_vocab = getattr(self.model.get_output_embeddings(), "vocab_ids", None)
        self.engine = engine_for(self.model, spec.dtype)
        if self.steering and isinstance(self.engine, LlamaEngine):
            self.engine.up_delta = self.steering.delta  # transformers' modules get theirs through hooks
        check_tree_attention(self.engine, self.model.config)

    def open_session(self, session_id: str, context: list[int], sampling: Sampling, verifier_fingerprint: str) -> DrafterSession:
        if verifier_fingerprint and self.fingerprint and verifier_fingerprint != self.fingerprint:
            raise invalid(
                "mismatched tokenizers: verifier_tokenizer_fingerprint is not this drafter's "
                f"({verifier_fingerprint} vs {self.fingerprint}); a pair must share one tokenizer"
            )
        check_context(context, self.vocab_size, self.max_context, "start.context_token_ids")
        session = self._new_session(list(context), sampling)
        self.sessions.put(session_id, session)
        return session

    def _new_session(self, context: list[int], sampling: Sampling) -> DrafterSession:
        session = self.session_type(context, sampling, torch.Generator().manual_seed(sampling.seed ^ 0x5EED), self._new_cache())
        session.prompt_length = len(context)
        session.ngram = NgramIndex(self.proposers["suffix"].settings.max_ngram, context)
        session.own = self.shared_choices or OwnChoices()
        return session

    def end_session(self, session_id: str) -> bool:
        """Frees a session; an n-gram stage remembers its output for later requests."""
        session = self.sessions.pop(session_id)
        if session is not None:
            for proposer in self.proposers.values():
                proposer.finished(session.tokens[session.prompt_length :])
        return session is not None

    def _proposer(self, shape: TreeShape) -> NgramProposer | None:
        """The n-gram proposer a request asked for (tree.ngram), else the default; None = none."""
        method = shape.ngram or self.default_ngram
        return None if method == "none" else self.proposers[method]

    def _new_cache(self) -> KVCache | TransformersCache:
        return self.engine.new_cache()

    def draft(self, *args, **kwargs) -> Draft:
        """draft_job run alone, on this thread."""
        return run_alone(self.draft_job(*args, **kwargs), self.forward_many)

    def forward_many(self, forwards: list[DraftForward]) -> list[Any]:
        """The forwards of several draft jobs: the unsteered ones in one pass of the engine,
        each steered one alone."""
        plain = [i for i, f in enumerate(forwards) if f.deltas is None]
        results: list[Any] = [None] * len(forwards)
        for i, result in zip(plain, self.engine.forward_many([forwards[i].call for i in plain])):
            results[i] = result
        for i in (i for i, f in enumerate(forwards) if f.deltas is not None):
            with self.steering.applied(forwards[i].deltas):
                results[i] = self.engine.forward_many([forwards[i].call])[0]
        return results

    def draft_job(
        self,
        session_id: str,
        session: DrafterSession,
        new_tokens: list[int],
        committed_length: int,
        num_tokens: int,
        shape: TreeShape,
        assumed: list[int] = (),
        steering: torch.Tensor | None = None,
        features: tuple[int, torch.Tensor] | None = None,
        pick_excludes: list[int] = (),
        round_number: int = 0,
    ) -> Generator[Any, Any, Draft]:
        """A job (specdec/core/batching.py) whose value is the Draft. Commits new_tokens and drafts a tree of at most num_tokens nodes after the context.
        With `assumed` tokens (overlapped drafting) the tree is drafted after the context plus
        those tokens plus the drafter's own pick of the next one (its likeliest outside
        `pick_excludes`), all uncommitted. A steering
        vector steers every token this call feeds; `features` (first position, rows) are the
        verifier's, for a drafter that reads them. A call repeating the session's last
        `round_number` (a retry after a lost answer) gets that round's draft again and commits
        nothing twice; 0 = unnumbered."""
        cap = self.limits.max_draft_tokens
        if not 1 <= num_tokens <= cap:
            raise invalid(f"num_draft_tokens must be in [1, {cap}], got {num_tokens}")
        try:
            shape.validate(cap)
        except ValueError as err:
            raise invalid(f"tree_shape: {err}") from None
        self._proposer(shape)  # refuses an n-gram choice this drafter cannot serve
        for name, ids in (("new_token_ids", new_tokens), ("assumed_token_ids", assumed), ("pick_excludes", pick_excludes)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid(f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        with session.lock:
            if round_number and round_number == session.last_round and session.last_draft is not None:
                return session.last_draft
            if len(session.tokens) + len(new_tokens) != committed_length:
                self.sessions.pop(session_id)
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session '{session_id}' is out of sync: it holds {len(session.tokens)} tokens, "
                    f"{len(new_tokens)} new ones do not make committed_length {committed_length}; re-open it",
                )
            if committed_length + len(assumed) + 1 + num_tokens > self.max_context:
                raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, f"drafting would exceed the model's context of {self.max_context}")
            check_kv_room(committed_length + len(assumed) + 1 + num_tokens, self.kv_bytes_per_token, self.limits)
            if features is not None:
                self._take_features(session, *features)
            session.tokens.extend(new_tokens)
            if session.ngram is not None:
                session.ngram.extend(new_tokens)
            if session.lesson is not None:
                proposer, last = session.lesson
                proposer.learn(last, new_tokens)
                session.lesson = None
            start, forwards = time.perf_counter(), session.forward_passes
            context = session.tokens + list(assumed)
            # An overlapped draft picks the next token itself, also where the guess assumes none
            # were accepted (no assumed tokens; the rejected ones excluded from the pick).
            pick = bool(assumed) or bool(pick_excludes)
            tree, steering_ms, confidence = yield from self._draft_after(session, context, shape, num_tokens, pick, pick_excludes, steering)
            draft = Draft(
                tree, context[len(session.tokens) :], (time.perf_counter() - start) * 1e3, steering_ms, session.forward_passes - forwards, confidence
            )
            session.last_round, session.last_draft = round_number, draft
            return draft

    def _ngram_draft(self, session: DrafterSession, proposer: NgramProposer, context: list[int], budget: int, max_depth: int, pick: bool) -> NgramDraft:
        """The proposer's draft after `context`; one made right after the committed tokens is
        kept, to learn from what gets committed next."""
        draft = proposer.propose(session.ngram, context, budget, max_depth)
        session.lesson = (proposer, draft) if draft.tree and not pick else None
        return draft

    def _draft_after(
        self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int, pick: bool, pick_excludes: list[int],
        steering: torch.Tensor | None,
    ) -> Job:
        """The tree after `context` (first extended by the drafter's pick of the next token when
        `pick`), the ms spent steering, and the nodes' confidences where all have one."""
        steering_ms = self._steer(session, steering)
        try:
            session.reuse_guesses = steering is None and not session.fed_steered
            session.fed_steered = steering is not None
            if pick:
                context.append((yield from self._pick_next(session, context, pick_excludes)))
            proposer = self._proposer(shape)
            if proposer is None:
                return (yield from self._draft_tree(session, context, shape, budget)), steering_ms, []
            # Greedy: the n-gram draft, then the model's nodes (at least one) fill the budget.
            # Sampling: a deterministic child cannot join children sampled from a proposal, so
            # where the context matched, the n-gram draft goes alone.
            greedy = session.sampling.greedy
            candidates = self._ngram_draft(session, proposer, context, budget - 1 if greedy else budget, shape.max_depth, pick)
            if not candidates:
                return (yield from self._draft_tree(session, context, shape, budget)), steering_ms, []
            if not greedy:
                return candidates.tree, steering_ms, candidates.confidence
            model = yield from self._draft_tree(session, context, shape, budget - len(candidates))
            return merge_trees(candidates.tree, model, budget), steering_ms, []
        finally:
            session.deltas = None

    def _take_features(self, session: DrafterSession, start: int, rows: torch.Tensor) -> None:
        raise invalid("features were sent, but this drafter does not read verifier features (it is not a feature head)")

    def _steer(self, session: DrafterSession, vector: torch.Tensor | None) -> float:
        """Makes the per-layer deltas of `vector` (None = unsteered), which every forward of
        the session's running draft adds; returns the ms that took."""
        if vector is None:
            session.deltas = None
            return 0.0
        start = time.perf_counter()
        session.deltas = list(self.steering.deltas(vector.to(self.model.device)).unbind(-2))
        return (time.perf_counter() - start) * 1e3

    def _forward(self, session: DrafterSession, input_ids: list[int], num_logits: int = 1, **masking) -> Job:
        session.forward_passes += 1
        logits, _ = yield DraftForward(ForwardCall(session.cache, input_ids, num_logits, **masking), session.deltas)
        return logits[:, : self.vocab_size] if self.draft_vocab is None else logits[:, self.draft_vocab]

    def _reuse_cache(self, session: DrafterSession, context: list[int]) -> list[int]:
        """Keeps the cached tokens that still match `context` and the fed nodes along the path
        that was committed; returns the context tokens still to feed (at least the last one)."""
        keep = 0
        limit = min(len(session.cached_tokens), len(context) - 1)
        while keep < limit and session.cached_tokens[keep] == context[keep]:
            keep += 1
        if keep < len(session.cached_tokens):  # a wrong assumption, or drafting again without a commit
            session.cache.truncate(keep)
            del session.cached_tokens[keep:]
            session.fed_tree = DraftTree()
        prefix = len(session.cached_tokens)
        new = context[prefix:]
        tree, kept, node = session.fed_tree, [], ROOT
        reusable = lambda c: session.reuse_guesses or c in session.fed_expanded  # noqa: E731
        for token in new[:-1]:
            node = next((c for c in tree.children(node) if tree.token_ids[c] == token and reusable(c)), None)
            if node is None:
                break
            kept.append(prefix + node)
        session.cache.keep_positions(prefix, kept)
        session.cached_tokens.extend(new[: len(kept)])
        return new[len(kept) :]

    def _feed_context(self, session: DrafterSession, context: list[int], guess: DraftTree | None = None) -> Job:
        """Brings the cache up to `context`, then feeds `guess` (a tree after it) in the same
        forward; returns the logits of the token after the context, then after each guess node."""
        pending = self._reuse_cache(session, context)
        if guess:
            positions, mask = verification_inputs(guess, len(session.cached_tokens), len(pending))
            logits = yield from self._forward(session, pending + guess.token_ids, 1 + len(guess), position_ids=positions, attention_mask=mask)
        else:
            logits = (yield from self._forward(session, pending))[-1:]
        session.cached_tokens.extend(pending)
        session.fed_tree = DraftTree() if guess is None else guess  # the same object the builder grows
        return logits

    def _pick_next(self, session: DrafterSession, context: list[int], excludes: list[int] = ()) -> Job:
        """The drafter's guess of the token after `context`: its likeliest one not in `excludes`."""
        logits = (yield from self._feed_context(session, context))[0].clone()
        vocab = torch.arange(len(logits)) if self.draft_vocab is None else self.draft_vocab
        logits[torch.isin(vocab, torch.tensor(list(excludes), dtype=torch.long))] = float("-inf")
        return int(vocab[greedy_tokens(logits)[0]])

    def _guess(self, session: DrafterSession, tail: list[int]) -> DraftTree:
        """The second stage's guess of what the drafter drafts after `tail`: what it drafted
        before after the same tokens (in any session, with memory across requests; Katz-style
        back-off from three tokens to one), else what followed them in the context."""
        if not self.stage2:
            return DraftTree()
        own = session.own.guess(tail, self.lookahead)
        if not own:
            return self.stage2.propose(session.ngram, tail, self.lookahead, self.lookahead).tree
        return DraftTree(own, list(range(-1, len(own) - 1)))

    def _draft_tree(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        fed = self._guess(session, context)
        logits = yield from self._feed_context(session, context, fed)
        num_context = len(session.cached_tokens)
        logits_of = {ROOT: logits[0]} | {n: logits[1 + n] for n in range(len(fed))}
        fed_child = {(p, t): n for n, (p, t) in enumerate(zip(fed.parent, fed.token_ids))}
        fed_node = {ROOT: ROOT}  # the builder's nodes -> fed_tree's

        def expand(tree: DraftTree, nodes: list[int]) -> Generator[Any, Any, list[NextToken]]:
            new = []
            for node in nodes:
                if node == ROOT:
                    continue
                if self.stage2:
                    before = context[-OwnChoices.ORDERS[0] :] + [tree.token_ids[n] for n in tree.path_to(tree.parent[node])]
                    session.own.record(before, tree.token_ids[node])
                key = (fed_node[tree.parent[node]], tree.token_ids[node])
                if key not in fed_child:  # not guessed by the second stage: fed now
                    fed_child[key] = fed.add(key[1], key[0])
                    new.append(fed_child[key])
                fed_node[node] = fed_child[key]
            if new:
                path = [fed.token_ids[n] for n in fed.path_to(new[0])]
                guess = self._guess(session, context + path)
                where = {ROOT: new[0]}
                for n, (parent, token) in enumerate(zip(guess.parent, guess.token_ids)):
                    where[n] = fed_child[where[parent], token] = fed.add(token, where[parent])
                    new.append(where[n])
                positions, mask = node_inputs(fed, list(range(new[0])), new, num_context)
                out = yield from self._forward(session, [fed.token_ids[n] for n in new], len(new), position_ids=positions, attention_mask=mask)
                logits_of.update(zip(new, out))
            return self._next_tokens(torch.stack([logits_of[fed_node[n]] for n in nodes]), session.sampling)

        rescore = None
        if shape.method == "lattice-ngram":
            lm, tail = NgramLM(session.ngram), context[-session.ngram.max_n :]

            def rescore(path: list[int], candidates: list[tuple[int, float]]) -> list[float]:
                # An even mixture: where the context says nothing, the drafter's ranking stands.
                probs = lm.probs(tail + path, [token for token, _ in candidates])
                return [math.log(0.5 * math.exp(logq) + 0.5 * p) for (_, logq), p in zip(candidates, probs)]
        generator = None if session.sampling.greedy else session.generator
        tree = yield from builder_for(shape, rescore).build(expand, budget, generator)
        session.fed_expanded = set(fed_node.values()) - {ROOT}
        return tree

    def _next_tokens(self, logits: torch.Tensor, sampling: Sampling) -> list[NextToken]:
        """The distribution after each of several nodes, from their logits (rows) over the
        draft vocabulary (`draft_vocab`, else the whole vocabulary)."""
        if sampling.greedy:
            return [NextToken(probs, self.draft_vocab) for probs in torch.softmax(logits.double(), dim=-1)]
        proposals = [self._proposal(row, sampling) for row in logits]
        return [NextToken(torch.tensor(p.probs, dtype=torch.float64), torch.tensor(p.token_ids), p) for p in proposals]

    def _proposal(self, logits: torch.Tensor, sampling: Sampling) -> Proposal:
        """The sparse distribution the next token is drawn from, exactly as the verifier will
        rebuild it from the float32 wire values."""
        probs = warp_probs(logits, sampling)
        top = torch.topk(probs, min(self.proposal_top_k, probs.shape[-1]))
        keep = top.values > 0
        values = top.values[keep]
        tokens = top.indices[keep] if self.draft_vocab is None else self.draft_vocab[top.indices[keep]]
        return Proposal(tokens.tolist(), (values / values.sum()).float().tolist())
