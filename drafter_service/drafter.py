"""The drafter's model-side logic: sessions with a KV cache that follows the committed
context, and draft proposals (greedy picks, or samples with their sparse proposal)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import torch
from transformers import DynamicCache

from specdec.kv_cache import truncate
from specdec.models import ModelSpec, eos_token_ids, load_model, load_tokenizer, max_context, tokenizer_fingerprint
from specdec.rpc import ServiceError, invalid
from specdec.sampling import Sampling, sample, warp_probs
from specdec.sessions import SessionStore, check_context
from specdec.tree import ROOT, DraftTree, Proposal


@dataclass
class DrafterSession:
    tokens: list[int]  # the committed context
    sampling: Sampling
    generator: torch.Generator
    cache: DynamicCache
    cached_tokens: list[int] = field(default_factory=list)  # what the cache holds, drafts included
    lock: threading.Lock = field(default_factory=threading.Lock)


class DrafterEngine:
    def __init__(
        self,
        spec: ModelSpec,
        proposal_top_k: int = 32,
        max_sessions: int = 64,
        session_ttl_s: float = 600.0,
        max_draft_tokens: int = 64,
    ):
        self.spec = spec
        self.model = load_model(spec)
        self.tokenizer = load_tokenizer(spec.source)
        self.vocab_size = len(self.tokenizer)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.max_context = max_context(self.model)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.proposal_top_k = proposal_top_k
        self.max_draft_tokens = max_draft_tokens
        self.sessions: SessionStore[DrafterSession] = SessionStore(max_sessions, session_ttl_s)
        self._model_lock = threading.Lock()

    def open_session(self, session_id: str, context: list[int], sampling: Sampling, verifier_fingerprint: str) -> DrafterSession:
        if verifier_fingerprint and verifier_fingerprint != self.fingerprint:
            raise invalid(
                "mismatched tokenizers: the verifier's tokenizer differs from this drafter's "
                f"({verifier_fingerprint} vs {self.fingerprint}); a pair must share one tokenizer"
            )
        check_context(context, self.vocab_size, self.max_context, "start.context_token_ids")
        session = DrafterSession(
            list(context), sampling, torch.Generator().manual_seed(sampling.seed ^ 0x5EED), DynamicCache(config=self.model.config)
        )
        self.sessions.put(session_id, session)
        return session

    def draft(self, session_id: str, session: DrafterSession, new_tokens: list[int], committed_length: int, num_tokens: int) -> tuple[DraftTree, float]:
        if not 1 <= num_tokens <= self.max_draft_tokens:
            raise invalid(f"num_draft_tokens must be in [1, {self.max_draft_tokens}], got {num_tokens}")
        bad = [t for t in new_tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(f"new_token_ids has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        with session.lock:
            if len(session.tokens) + len(new_tokens) != committed_length:
                self.sessions.pop(session_id)
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"session '{session_id}' is out of sync: it holds {len(session.tokens)} tokens, "
                    f"{len(new_tokens)} new ones do not make committed_length {committed_length}; re-open it",
                )
            if committed_length + num_tokens > self.max_context:
                raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, f"drafting would exceed the model's context of {self.max_context}")
            session.tokens.extend(new_tokens)
            start = time.perf_counter()
            with self._model_lock, torch.inference_mode():
                tree = self._draft_chain(session, num_tokens)
            return tree, (time.perf_counter() - start) * 1e3

    def _forward(self, session: DrafterSession, input_ids: list[int]) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([input_ids], device=self.model.device),
            past_key_values=session.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        session.cached_tokens.extend(input_ids)
        return out.logits[0, -1, : self.vocab_size].float()

    def _reuse_cache(self, session: DrafterSession) -> list[int]:
        """Keeps the cached prefix that still matches the context (accepted drafts included);
        returns the context tokens still to feed, at least the last one."""
        keep = 0
        limit = min(len(session.cached_tokens), len(session.tokens) - 1)
        while keep < limit and session.cached_tokens[keep] == session.tokens[keep]:
            keep += 1
        truncate(session.cache, keep)
        del session.cached_tokens[keep:]
        return session.tokens[keep:]

    def _draft_chain(self, session: DrafterSession, num_tokens: int) -> DraftTree:
        tree = DraftTree()
        logits = self._forward(session, self._reuse_cache(session))
        for i in range(num_tokens):
            parent = ROOT if i == 0 else i - 1
            if session.sampling.greedy:
                token = int(logits.argmax())
            else:
                proposal, probs = self._proposal(logits, session.sampling)
                token = sample(probs, session.generator)
                tree.proposals[parent] = proposal
            tree.token_ids.append(token)
            tree.parent.append(parent)
            if i + 1 < num_tokens:
                logits = self._forward(session, [token])
        return tree

    def _proposal(self, logits: torch.Tensor, sampling: Sampling) -> tuple[Proposal, torch.Tensor]:
        """The sparse distribution the next token is drawn from, and that same distribution
        dense, exactly as the verifier will rebuild it from the float32 wire values."""
        probs = warp_probs(logits, sampling)
        top = torch.topk(probs, min(self.proposal_top_k, probs.shape[-1]))
        keep = top.values > 0
        values = top.values[keep]
        proposal = Proposal(top.indices[keep].tolist(), (values / values.sum()).float().tolist())
        return proposal, proposal.dense(probs.shape[-1])
