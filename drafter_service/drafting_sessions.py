"""The drafter service's side of every drafting method (drafter_service/drafting.py): sessions
that follow the committed context, the checks of each Draft call, retried rounds, overlapped
drafting's pick, and the n-gram methods' memory across requests."""
from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch

from drafter_service.drafting import Draft, Drafter, DrafterSession, ScoredTree, VerifierState
from specdec.core.batching import run_alone
from specdec.core.errors import PastContext, RequestError, StaleSession
from specdec.core.grammar import Constraint, ConstraintError
from specdec.core.ngram import NgramIndex, NgramProposer
from specdec.core.sampling import Sampling
from specdec.core.tree import ROOT, DraftTree, TreeShape
from specdec.serving.config import LimitsConfig
from specdec.serving.sessions import SessionStore, check_context, check_kv_room


class DraftingSessions:
    """Serves one drafter. `ngram_methods`: the n-gram proposers its drafts may use (hybrid,
    staged, model-free), shared so that they learn from every session's output; each session
    indexes its context for n-grams of up to `max_ngram` tokens."""

    def __init__(
        self, drafter: Drafter, ngram_methods: dict[str, NgramProposer], max_ngram: int, source: str, limits: LimitsConfig = LimitsConfig()
    ):
        self.drafter, self.info, self.source, self.limits = drafter, drafter.info, source, limits
        self.ngram_methods, self.max_ngram = ngram_methods, max_ngram
        self.sessions: SessionStore[DrafterSession] = SessionStore(
            limits.max_sessions, limits.session_ttl_s, int(limits.max_kv_mib * 2**20), lambda session: drafter.state_bytes(session.state)
        )

    def open_session(
        self, session_id: str, context: list[int], sampling: Sampling, verifier_fingerprint: str, constraint: Constraint | None = None,
        prompt_length: int = 0,
    ) -> DrafterSession:
        """A session after `context`; with a `constraint` (its output after `prompt_length` tokens),
        a drafter that reads the verifier's tokens masks its proposals by it."""
        info = self.info
        if verifier_fingerprint and info.fingerprint and verifier_fingerprint != info.fingerprint:
            raise RequestError(
                "mismatched tokenizers: verifier_tokenizer_fingerprint is not this drafter's "
                f"({verifier_fingerprint} vs {info.fingerprint}); a pair must share one tokenizer, unless the drafter "
                "maps its drafts (drafter.tokenizer: own, with the verifier's model as verifier.model)"
            )
        check_context(context, info.vocab_size, info.max_context, "start.context_token_ids")
        session = DrafterSession(
            list(context), sampling, torch.Generator().manual_seed(sampling.seed ^ 0x5EED), NgramIndex(self.max_ngram, context),
            self.drafter.new_state(list(context), sampling), prompt_length=len(context),
        )
        if constraint is not None and self.drafter.grammars is not None:
            try:
                session.grammar, _ = self.drafter.grammars.state(constraint)
            except ConstraintError:
                pass  # the verifier refuses it with the reason; unmasked drafts are exact all the same
            if session.grammar is not None and not session.grammar.advance(context[prompt_length or len(context) :]):
                session.grammar = None
        self.sessions.put(session_id, session)
        return session

    def end_session(self, session_id: str) -> bool:
        """Frees a session; the n-gram methods remember its output for later requests."""
        session = self.sessions.pop(session_id)
        if session is not None:
            for proposer in self.ngram_methods.values():
                proposer.finished(session.tokens[session.prompt_length :])
        return session is not None

    def forward_many(self, forwards: list) -> list[Any]:
        return self.drafter.forward_many(forwards)

    def draft(self, **request) -> Draft:
        """draft_job run alone, on this thread."""
        return run_alone(self.draft_job(**request), self.forward_many)

    def draft_job(
        self,
        *,
        session_id: str,
        session: DrafterSession,
        new_tokens: list[int],
        committed_length: int,
        num_tokens: int,
        shape: TreeShape,
        assumed: list[int] = (),
        steering: torch.Tensor | None = None,
        verifier_state: VerifierState | None = None,
        pick_excludes: list[int] = (),
        forced: list[int] = (),
        round_number: int = 0,
    ) -> Generator[Any, Any, Draft]:
        """A job (specdec/core/batching.py) whose value is the Draft: commits new_tokens and drafts
        a tree of at most num_tokens nodes after the context. With `assumed` tokens (overlapped
        drafting) the tree is drafted after the context plus those tokens plus the drafter's own
        pick of the next one (its likeliest outside `pick_excludes`), all uncommitted. A steering
        vector steers every token this call feeds; `verifier_state` is the verifier's, for a
        drafter that reads it. A call repeating the session's last
        `round_number` (a retry after a lost answer) gets that round's draft again and commits
        nothing twice; 0 = unnumbered."""
        cap, info = self.limits.max_draft_tokens, self.info
        if not 1 <= num_tokens <= cap:
            raise RequestError(f"num_draft_tokens must be in [1, {cap}], got {num_tokens}")
        try:
            shape.check_limit(cap)
        except ValueError as err:
            raise RequestError(f"tree_shape: {err}") from None
        self.drafter.check(shape)
        for name, ids in (
            ("new_token_ids", new_tokens), ("assumed_token_ids", assumed), ("pick_excludes", pick_excludes), ("forced_token_ids", forced)
        ):
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise RequestError(f"{name} has token ids outside the vocabulary [0, {info.vocab_size}): {bad[:5]}")
        with session.lock:
            if round_number and round_number == session.last_round and session.last_draft is not None:
                return session.last_draft
            if len(session.tokens) + len(new_tokens) != committed_length:
                self.sessions.pop(session_id)
                raise StaleSession(
                    f"session '{session_id}' is out of sync: it holds {len(session.tokens)} tokens, "
                    f"{len(new_tokens)} new ones do not make committed_length {committed_length}; re-open it"
                )
            ahead = len(assumed) + 1 + len(forced) + num_tokens
            if committed_length + ahead > info.max_context:
                raise PastContext(f"drafting would exceed the model's context of {info.max_context}")
            check_kv_room(committed_length + ahead, info.kv_bytes_per_token, self.limits)
            if verifier_state is not None:
                self.drafter.take_verifier_state(session, verifier_state)
            self._commit(session, new_tokens)
            start, before = time.perf_counter(), _counters(session)
            context = session.tokens + list(assumed)
            steering_ms = self.drafter.begin_round(session, steering)
            try:
                proposal = yield from self._draft_after(session, context, shape, num_tokens, pick_excludes, list(forced))
            finally:
                self.drafter.end_round(session)
            forwards, own_tokens, rollbacks, mapping_ms = (now - then for now, then in zip(_counters(session), before))
            draft = Draft(
                tree=proposal.tree, assumed=context[len(session.tokens) :], compute_ms=(time.perf_counter() - start) * 1e3,
                steering_ms=steering_ms, forward_passes=forwards, confidence=proposal.confidence, own_tokens_drafted=own_tokens,
                reencode_rollbacks=rollbacks, mapping_ms=mapping_ms,
            )
            session.last_round, session.last_draft = round_number, draft
            return draft

    def _commit(self, session: DrafterSession, new_tokens: list[int]) -> None:
        session.tokens.extend(new_tokens)
        if session.grammar is not None and not session.grammar.advance(new_tokens):
            session.grammar = None
        session.ngram.extend(new_tokens)
        if session.lesson is not None:
            proposer, last = session.lesson
            proposer.learn(last, new_tokens)
            session.lesson = None

    def _draft_after(
        self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int, pick_excludes: list[int], forced: list[int]
    ):
        """The tree after `context`, first extended by the drafter's pick of the next token in
        overlapped drafting (assumed tokens, or a guess that none were accepted: the rejected
        ones excluded from the pick; no pick, no draft), then by the `forced` tokens."""
        if len(context) > len(session.tokens) or pick_excludes:
            picked = yield from self.drafter.pick(session, context, shape, pick_excludes)
            if picked is None:
                return ScoredTree(DraftTree(), [])
            context.append(picked)
        session.draft_states = None
        if session.grammar is not None:  # the proposals masked from the drafting context on
            root = session.grammar.copy()
            if root.advance(context[len(session.tokens) :] + forced):
                session.draft_states = {ROOT: root}
        return (yield from self.drafter.draft(session, context + forced, shape, budget))


def _counters(session: DrafterSession) -> tuple:
    return session.forward_passes, session.own_tokens_drafted, session.reencode_rollbacks, session.mapping_ms
