"""The verifier's model-side logic: sessions with a KV cache of exactly the committed tokens,
one-pass tree verification, verifier-only ("fused") generation, and the SD² steering vector
read from the hidden states of the last position each round reads."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import torch

from specdec.core.engine import engine_for
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
from specdec.core.sampling import (
    Sampling,
    accept_greedy,
    accept_sampled,
    sample,
    warp_probs,
)
from specdec.core.steering import load_verifier_steering, vector_to_tensor_fields
from specdec.core.tree import DraftTree, MalformedTree, verification_inputs
from specdec.serving.rpc import ServiceError, invalid
from specdec.serving.sessions import SessionStore, check_context


@dataclass
class RoundResult:
    token_ids: list[int]
    num_accepted: int
    committed_length: int
    compute_ms: float
    steering: dict | None = None  # common.Tensor fields of the steering vector, when asked for
    steering_ms: float = 0.0


@dataclass
class VerifierSession:
    tokens: list[int]  # the committed context
    sampling: Sampling
    generator: torch.Generator
    cache: KVCache | TransformersCache
    last_round: int = 0
    last_result: RoundResult | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def num_cached(self) -> int:
        return self.cache.get_seq_length()


class VerifierEngine:
    def __init__(
        self, spec: ModelSpec, max_sessions: int = 64, session_ttl_s: float = 600.0, max_tree_nodes: int = 256,
        steering_checkpoint: str | None = None,
    ):
        self.spec = spec
        self.model = load_model(spec)
        self.engine = engine_for(self.model, spec.dtype)
        check_tree_attention(self.engine, self.model.config)
        self.tokenizer = load_tokenizer(spec.source)
        self.vocab_size = len(self.tokenizer)
        self.eos_ids = set(eos_token_ids(self.model, self.tokenizer))
        self.max_context = max_context(self.model)
        self.max_tree_nodes = max_tree_nodes
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.sessions: SessionStore[VerifierSession] = SessionStore(max_sessions, session_ttl_s)
        self._model_lock = threading.Lock()  # one forward pass at a time on a shared model
        self.steering, self.steering_fingerprint = None, ""
        if steering_checkpoint:
            self.steering, self.steering_fingerprint = load_verifier_steering(steering_checkpoint, self.model)
        self.steering_size = self.model.config.hidden_size if self.steering else 0

    def open_session(self, session_id: str, context: list[int], sampling: Sampling) -> VerifierSession:
        check_context(context, self.vocab_size, self.max_context, "start.context_token_ids")
        generator = torch.Generator().manual_seed(sampling.seed)
        session = VerifierSession(list(context), sampling, generator, self.engine.new_cache())
        self.sessions.put(session_id, session)
        return session

    def verify(self, session: VerifierSession, round_number: int, tree: DraftTree, fused_tokens: int, steering: bool = False) -> RoundResult:
        with session.lock:
            if round_number == session.last_round and session.last_result is not None:
                return session.last_result  # a retried round commits nothing twice
            if round_number != session.last_round + 1:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"round {round_number} out of order: the session's last round was {session.last_round}",
                )
            try:
                tree.validate(self.vocab_size)
            except MalformedTree as err:
                raise invalid(str(err)) from None
            if steering and self.steering is None:
                raise invalid("steering was asked for, but this verifier has no steering checkpoint loaded (the config's steering_checkpoint)")
            if len(tree) > self.max_tree_nodes:
                raise invalid(f"tree has {len(tree)} nodes; this verifier takes at most {self.max_tree_nodes}")
            if len(session.tokens) + len(tree) + max(fused_tokens, 1) > self.max_context:
                raise ServiceError(
                    grpc.StatusCode.OUT_OF_RANGE,
                    f"the session would exceed the model's context of {self.max_context} tokens",
                )
            start = time.perf_counter()
            with self._model_lock, torch.inference_mode():
                if len(tree) == 0:
                    (new_tokens, last_read), num_accepted = self._generate(session, max(fused_tokens, 1), steering), 0
                else:
                    new_tokens, last_read = self._verify_tree(session, tree, steering)
                    num_accepted = len(new_tokens) - 1
                steering_start = time.perf_counter()
                vector = vector_to_tensor_fields(self.steering(last_read)) if steering else None
                steering_ms = (time.perf_counter() - steering_start) * 1e3
            compute_ms = (time.perf_counter() - start) * 1e3
            session.tokens.extend(new_tokens)
            result = RoundResult(new_tokens, num_accepted, len(session.tokens), compute_ms, vector, steering_ms)
            session.last_round, session.last_result = round_number, result
            return result

    def _forward(self, session: VerifierSession, input_ids: list[int], num_logits: int, steering: bool, **masking):
        """(logits of the last num_logits positions, hidden states of every layer or None)."""
        return self.engine(session.cache, input_ids, num_logits, hidden_states=steering, **masking)

    def _choose(self, session: VerifierSession, logits: torch.Tensor) -> int:
        if session.sampling.greedy:
            return int(logits.argmax())
        return sample(warp_probs(logits, session.sampling), session.generator)

    def _generate(self, session: VerifierSession, max_tokens: int, steering: bool) -> tuple[list[int], tuple | None]:
        """The new tokens, and (with steering) the hidden states of the last position read."""
        new: list[int] = []
        pending = session.tokens[session.num_cached :]
        for _ in range(max_tokens):
            logits, hidden = self._forward(session, pending, 1, steering)
            token = self._choose(session, logits[-1])
            new.append(token)
            if token in self.eos_ids:
                break
            pending = [token]
        return new, _at(hidden, -1)

    def _verify_tree(self, session: VerifierSession, tree: DraftTree, steering: bool) -> tuple[list[int], tuple | None]:
        num_cached = session.num_cached
        pending = session.tokens[num_cached:]
        positions, mask = verification_inputs(tree, num_cached, len(pending))
        logits, hidden = self._forward(
            session,
            pending + tree.token_ids,
            len(tree) + 1,
            steering,
            position_ids=positions,
            attention_mask=mask,
        )
        if session.sampling.greedy:
            path, next_token = accept_greedy(tree, logits.argmax(dim=-1).tolist())
        else:
            path, next_token = accept_sampled(tree, warp_probs(logits, session.sampling), session.generator)
        committed_len = num_cached + len(pending)
        session.cache.keep_positions(committed_len, [committed_len + node for node in path])
        # The last position read is the last accepted node (or the root): its output gave the new token.
        last_read = len(pending) + path[-1] if path else len(pending) - 1
        return [tree.token_ids[node] for node in path] + [next_token], _at(hidden, last_read)


def _at(hidden_states: tuple | None, position: int) -> tuple | None:
    """Every layer's hidden state at one position of a single-sequence forward."""
    return None if hidden_states is None else tuple(h[0, position] for h in hidden_states)

