"""The drafter's model-side logic: sessions with a KV cache that follows the committed
context, and draft proposals (greedy picks, or samples with their sparse proposal),
optionally steered by the verifier's SD² vector."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from drafter_service.tree_builders import NextToken, builder_for
from specdec.core.engine import LlamaEngine, engine_for
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
from specdec.core.sampling import Sampling, warp_probs
from specdec.core.steering import load_drafter_steering
from specdec.core.tree import (
    MAX_DRAFT_NODES,
    ROOT,
    DraftTree,
    Proposal,
    TreeShape,
    node_inputs,
)
from specdec.serving.rpc import ServiceError, invalid
from specdec.serving.sessions import SessionStore, check_context


@dataclass
class DrafterSession:
    tokens: list[int]  # the committed context
    sampling: Sampling
    generator: torch.Generator
    cache: KVCache | TransformersCache
    # The cache holds cached_tokens (committed) and then the last draft's fed nodes, in order.
    cached_tokens: list[int] = field(default_factory=list)
    last_draft: DraftTree = field(default_factory=DraftTree)
    fed_nodes: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class DrafterEngine:
    session_type = DrafterSession
    def __init__(
        self,
        spec: ModelSpec,
        proposal_top_k: int = 32,
        max_sessions: int = 64,
        session_ttl_s: float = 600.0,
        max_draft_tokens: int = MAX_DRAFT_NODES,
        steering_checkpoint: str | None = None,
    ):
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.source)
        self.vocab_size = len(self.tokenizer)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.proposal_top_k = proposal_top_k
        self.max_draft_tokens = max_draft_tokens
        self.sessions: SessionStore[DrafterSession] = SessionStore(max_sessions, session_ttl_s)
        self._model_lock = threading.Lock()
        self.steering, self.steering_fingerprint = None, ""
        self.feature_size, self.feature_fingerprint = 0, ""  # a drafter that reads verifier features sets them
        self._load(spec, steering_checkpoint)

    def _load(self, spec: ModelSpec, steering_checkpoint: str | None) -> None:
        self.model = load_model(spec)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.max_context = max_context(self.model)
        if steering_checkpoint:
            self.steering, self.steering_fingerprint = load_drafter_steering(steering_checkpoint, self.model)
        self.steering_size = self.steering.norm.normalized_shape[0] if self.steering else 0
        self.engine = engine_for(self.model, spec.dtype)
        if self.steering and isinstance(self.engine, LlamaEngine):
            self.engine.up_delta = self.steering.delta  # transformers' modules get theirs through hooks
        check_tree_attention(self.engine, self.model.config)

    def open_session(self, session_id: str, context: list[int], sampling: Sampling, verifier_fingerprint: str) -> DrafterSession:
        if verifier_fingerprint and verifier_fingerprint != self.fingerprint:
            raise invalid(
                "mismatched tokenizers: the verifier's tokenizer differs from this drafter's "
                f"({verifier_fingerprint} vs {self.fingerprint}); a pair must share one tokenizer"
            )
        check_context(context, self.vocab_size, self.max_context, "start.context_token_ids")
        session = self._new_session(list(context), sampling)
        self.sessions.put(session_id, session)
        return session

    def _new_session(self, context: list[int], sampling: Sampling) -> DrafterSession:
        return self.session_type(context, sampling, torch.Generator().manual_seed(sampling.seed ^ 0x5EED), self._new_cache())

    def _new_cache(self) -> KVCache | TransformersCache:
        return self.engine.new_cache()

    def draft(
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
    ) -> tuple[DraftTree, list[int], float, float]:
        """Commits new_tokens and drafts a tree of at most num_tokens nodes after the context.
        With `assumed` tokens (overlapped drafting) the tree is drafted after the context plus
        those tokens plus the drafter's own pick of the next one (its likeliest outside
        `pick_excludes`), all uncommitted. A steering
        vector steers every token this call feeds; `features` (first position, rows) are the
        verifier's, for a drafter that reads them. Returns the tree, what it assumed, the
        compute time and, of it, the steering's, in ms."""
        if not 1 <= num_tokens <= self.max_draft_tokens:
            raise invalid(f"num_draft_tokens must be in [1, {self.max_draft_tokens}], got {num_tokens}")
        try:
            shape.validate()
        except ValueError as err:
            raise invalid(f"tree_shape: {err}") from None
        for name, ids in (("new_token_ids", new_tokens), ("assumed_token_ids", assumed), ("pick_excludes", pick_excludes)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid(f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        with session.lock:
            if len(session.tokens) + len(new_tokens) != committed_length:
                self.sessions.pop(session_id)
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session '{session_id}' is out of sync: it holds {len(session.tokens)} tokens, "
                    f"{len(new_tokens)} new ones do not make committed_length {committed_length}; re-open it",
                )
            if committed_length + len(assumed) + 1 + num_tokens > self.max_context:
                raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, f"drafting would exceed the model's context of {self.max_context}")
            if features is not None:
                self._take_features(session, *features)
            session.tokens.extend(new_tokens)
            start = time.perf_counter()
            context = session.tokens + list(assumed)
            with self._model_lock, torch.inference_mode(), self._steered(steering) as steering_ms:
                if assumed:
                    context.append(self._pick_next(session, context, pick_excludes))
                tree = self._draft_tree(session, context, shape, num_tokens)
            return tree, context[len(session.tokens) :], (time.perf_counter() - start) * 1e3, steering_ms[0]

    def _take_features(self, session: DrafterSession, start: int, rows: torch.Tensor) -> None:
        raise invalid("features were sent, but this drafter does not read verifier features (it is not a feature head)")

    @contextmanager
    def _steered(self, vector: torch.Tensor | None):
        """Forwards inside are steered by `vector` (None = unsteered); yields a one-item list
        that holds the ms spent making the per-layer deltas."""
        if vector is None:
            yield [0.0]
            return
        start = time.perf_counter()
        with self.steering.steer(vector.to(self.model.device)):
            yield [(time.perf_counter() - start) * 1e3]

    def _forward(self, session: DrafterSession, input_ids: list[int], num_logits: int = 1, **masking) -> torch.Tensor:
        logits, _ = self.engine(session.cache, input_ids, num_logits, **masking)
        return logits[:, : self.vocab_size]

    def _reuse_cache(self, session: DrafterSession, context: list[int]) -> list[int]:
        """Keeps the cached tokens that still match `context` and the last draft's cached
        nodes along the path that was committed; returns the context tokens still to feed
        (at least the last one)."""
        keep = 0
        limit = min(len(session.cached_tokens), len(context) - 1)
        while keep < limit and session.cached_tokens[keep] == context[keep]:
            keep += 1
        if keep < len(session.cached_tokens):  # a wrong assumption, or drafting again without a commit
            session.cache.truncate(keep)
            del session.cached_tokens[keep:]
            session.last_draft, session.fed_nodes = DraftTree(), []
        prefix = len(session.cached_tokens)
        new = context[prefix:]
        tree, positions = session.last_draft, {n: i for i, n in enumerate(session.fed_nodes)}
        kept, node = [], ROOT
        for token in new[:-1]:
            node = next((c for c in tree.children(node) if tree.token_ids[c] == token and c in positions), None)
            if node is None:
                break
            kept.append(prefix + positions[node])
        session.cache.keep_positions(prefix, kept)
        session.cached_tokens.extend(new[: len(kept)])
        return new[len(kept) :]

    def _feed_context(self, session: DrafterSession, context: list[int]) -> torch.Tensor:
        """Brings the cache up to `context` (no draft nodes after it); returns the logits
        of the token that follows."""
        pending = self._reuse_cache(session, context)
        logits = self._forward(session, pending)[-1]
        session.cached_tokens.extend(pending)
        session.last_draft, session.fed_nodes = DraftTree(), []
        return logits

    def _pick_next(self, session: DrafterSession, context: list[int], excludes: list[int] = ()) -> int:
        """The drafter's guess of the token after `context`: its likeliest one not in `excludes`."""
        logits = self._feed_context(session, context).clone()
        logits[list(excludes)] = float("-inf")
        return int(logits.argmax())

    def _draft_tree(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> DraftTree:
        root_logits = self._feed_context(session, context)
        num_context = len(session.cached_tokens)

        def expand(tree: DraftTree, nodes: list[int]) -> list[NextToken]:
            new = [n for n in nodes if n != ROOT]
            if new:
                positions, mask = node_inputs(tree, session.fed_nodes, new, num_context)
                logits = self._forward(
                    session,
                    [tree.token_ids[n] for n in new],
                    len(new),
                    position_ids=positions,
                    attention_mask=mask,
                )
                session.fed_nodes += new
            # The tree being built, whose numbering fed_nodes uses (a pruning builder
            # returns a renumbered subtree of it).
            session.last_draft = tree
            rows = {n: i for i, n in enumerate(new)}
            return [self._next_token(root_logits if n == ROOT else logits[rows[n]], session.sampling) for n in nodes]

        generator = None if session.sampling.greedy else session.generator
        return builder_for(shape).build(expand, budget, generator)

    def _next_token(self, logits: torch.Tensor, sampling: Sampling) -> NextToken:
        if sampling.greedy:
            return NextToken(torch.softmax(logits.double(), dim=-1))
        proposal, probs = self._proposal(logits, sampling)
        return NextToken(probs, proposal)

    def _proposal(self, logits: torch.Tensor, sampling: Sampling) -> tuple[Proposal, torch.Tensor]:
        """The sparse distribution the next token is drawn from, and that same distribution
        dense, exactly as the verifier will rebuild it from the float32 wire values."""
        probs = warp_probs(logits, sampling)
        top = torch.topk(probs, min(self.proposal_top_k, probs.shape[-1]))
        keep = top.values > 0
        values = top.values[keep]
        proposal = Proposal(top.indices[keep].tolist(), (values / values.sum()).float().tolist())
        return proposal, proposal.dense(probs.shape[-1])
