"""The verifier's model-side logic: sessions with a KV cache of exactly the committed tokens,
one-pass tree verification, verifier-only ("fused") generation, and the SD² steering vector
read from the hidden states of the last position each round reads."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.core.batching import Job, run_alone
from specdec.core.engine import ForwardCall, engine_for
from specdec.core.errors import PastContext, RequestError, StaleSession
from specdec.core.grammar import Constraint, ConstraintError, GrammarState, Grammars, mask_rows, mask_tree_rows
from specdec.core.feature_head import features_to_state, load_feature_fuse, state_name
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
from specdec.core.prefix_cache import BLOCK_TOKENS, PrefixCache
from specdec.core.sampling import (
    Sampling,
    accept_greedy,
    accept_sampled,
    greedy_tokens,
    position_generator,
    sample,
    warp_probs,
)
from specdec.core.steering import load_verifier_steering, vector_to_tensor_fields
from specdec.core.tree import DraftTree, MalformedTree, verification_inputs
from specdec.serving.config import LimitsConfig
from specdec.serving.sessions import SessionStore, check_context, check_kv_room


@dataclass(kw_only=True)  # a round's counts and times: named, so none can swap places
class RoundResult:
    token_ids: list[int]
    num_accepted: int
    committed_length: int
    compute_ms: float
    steering: dict | None = None  # common.Tensor fields of the steering vector, when asked for
    steering_ms: float = 0.0
    verifier_state: dict | None = None  # VerifierState fields (a feature head's features), when asked for
    verifier_state_ms: float = 0.0
    batch_rows: float = 0.0  # the passes this round ran in: mean rows, and mean sessions sharing them
    batch_sessions: float = 0.0
    grammar_ms: float = 0.0  # of compute_ms, masking logits by the session's constraint
    forced_drafted: int = 0  # fused generation's forced tokens fed, and kept (forced_drafts)
    forced_accepted: int = 0


@dataclass(frozen=True)
class PassSize:
    rows: int  # tokens fed by all the sessions in the pass
    sessions: int


@dataclass
class VerifierSession:
    tokens: list[int]  # the committed context
    sampling: Sampling
    cache: KVCache | TransformersCache
    last_round: int = 0
    last_result: RoundResult | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    prompt_length: int = 0  # the leading tokens that were the request's prompt
    passes: list[PassSize] = field(default_factory=list)  # the passes the running round has been in
    # keep_features: the fused features of positions [0, len(feature_rows)) kept, float16,
    # and how many of them were sent; rounds that ask for none send none.
    keep_features: bool = False
    feature_rows: list[torch.Tensor] = field(default_factory=list)
    features_sent: int = 0
    # [rows, 3, hidden] each: the depths of the positions after feature_rows, not fused yet
    unfused: list[torch.Tensor] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured outputs: where the committed output stands in its grammar
    grammar_ms: float = 0.0  # the running round's masking
    forced: list[int] = field(default_factory=lambda: [0, 0])  # the running round's forced tokens fed and kept

    @property
    def num_cached(self) -> int:
        return self.cache.get_seq_length()


class Verifier:
    def __init__(
        self, spec: ModelSpec, steering_checkpoint: str | None = None, feature_checkpoint: str | None = None,
        limits: LimitsConfig = LimitsConfig(), prefix_cache_mib: float = 0.0,
    ):
        self.spec = spec
        self.model = load_model(spec)
        self.weight_format = self.model.weight_format  # spec.dtype, or the format dtype auto chose
        self.engine = engine_for(self.model, self.weight_format)
        check_tree_attention(self.engine, self.model.config)
        self.tokenizer = load_tokenizer(spec.source)
        self.vocab_size = len(self.tokenizer)
        self.eos_ids = set(eos_token_ids(self.model, self.tokenizer))
        self.max_context = max_context(self.model)
        self.limits = limits
        self.kv_bytes_per_token = self.engine.kv_bytes_per_token
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.sessions: SessionStore[VerifierSession] = SessionStore.of_caches(limits)
        self._model_lock = threading.Lock()  # one forward pass at a time on a shared model
        self.steering, self.steering_fingerprint = None, ""
        if steering_checkpoint:
            self.steering, self.steering_fingerprint = load_verifier_steering(steering_checkpoint, self.model)
        self.steering_size = self.model.config.hidden_size if self.steering else 0
        # The verifier state it fills (ModelInfo.verifier_state): a feature head's features.
        self.fuse, self.verifier_state = None, ""
        if feature_checkpoint:
            self.fuse, self.verifier_state = load_feature_fuse(feature_checkpoint, self.model), state_name(feature_checkpoint)
        # Prompts read before, for sessions that start alike; with the states a feature head fuses.
        self.prefix = None
        if prefix_cache_mib and self.engine.batch_invariant:
            self.prefix = PrefixCache(int(prefix_cache_mib * 2**20), tuple(self.fuse.layers) if self.fuse else ())
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, sorted(self.eos_ids), limits.max_constraint_bytes)

    def grammar_state(self, constraint: Constraint, output: list[int]) -> GrammarState:
        """The constraint's grammar after `output` (a re-opened session's tokens so far)."""
        try:
            state, _ = self.grammars.state(constraint)
        except ConstraintError as err:
            raise RequestError(f"start.constraint: {err}") from None
        if not state.advance(output):
            raise RequestError("start.context_token_ids: the output after prompt_length breaks start.constraint")
        return state

    def check_sizes(self, num_nodes: int, num_parents: int, fused_tokens: int) -> None:
        """The size limits of a Verify call, checked before any work (a session opened, a tree
        read): a tree of at most limits.max_tree_nodes, or at most limits.max_fused_tokens verifier tokens."""
        max_nodes, max_fused = self.limits.max_tree_nodes, self.limits.max_fused_tokens
        if max(num_nodes, num_parents) > max_nodes:
            raise RequestError(f"tree has {max(num_nodes, num_parents)} nodes; this verifier takes at most {max_nodes}")
        if fused_tokens > max_fused:
            raise RequestError(f"fused_tokens is {fused_tokens}; this verifier generates at most {max_fused} per call")
        if fused_tokens and num_nodes:
            raise RequestError("fused_tokens is only for an empty tree (verifier-only generation)")

    def open_session(
        self, session_id: str, context: list[int], sampling: Sampling, prompt_length: int = 0, keep_verifier_state: bool = False,
        constraint: Constraint | None = None,
    ) -> VerifierSession:
        check_context(context, self.vocab_size, self.max_context, "start.context_token_ids")
        if prompt_length > len(context):
            raise RequestError(f"start.prompt_length {prompt_length} exceeds the context's {len(context)} tokens")
        if keep_verifier_state and self.fuse is None:
            raise RequestError(
                "start.keep_verifier_state asks for verifier state, but this verifier fills none: it has no feature head "
                "checkpoint loaded (a feature-head drafter's directory)"
            )
        prompt_length = prompt_length or len(context)
        grammar = self.grammar_state(constraint, context[prompt_length:]) if constraint is not None else None
        session = VerifierSession(
            list(context), sampling, self.engine.new_cache(), prompt_length=prompt_length, keep_features=keep_verifier_state,
            grammar=grammar,
        )
        self.sessions.put(session_id, session)
        return session

    def verify(
        self, session: VerifierSession, round_number: int, tree: DraftTree, fused_tokens: int, steering: bool = False,
        verifier_state: bool = False, forced_drafts: bool = False,
    ) -> RoundResult:
        """One round on its own (a service batches `verify_job`s of many sessions instead)."""
        job = self.verify_job(session, round_number, tree, fused_tokens, steering, verifier_state, forced_drafts)
        return run_alone(job, self.forward_many)

    def forward_many(self, calls: list[ForwardCall]) -> list:
        """Each call's (output, the size of the pass it shared)."""
        with self._model_lock, torch.inference_mode():
            outputs = self.engine.forward_many(calls)
        size = PassSize(sum(len(c.input_ids) for c in calls), len(calls))
        return [(output, size) for output in outputs]

    def verify_job(
        self, session: VerifierSession, round_number: int, tree: DraftTree, fused_tokens: int, steering: bool = False,
        verifier_state: bool = False, forced_drafts: bool = False,
    ) -> Job:
        """Commits the round's tokens (the accepted path and the next token, or `fused_tokens`
        of the verifier's own without a tree): a job yielding the forwards it needs. With
        `verifier_state`, the round also returns the features (this verifier's verifier state)
        of the positions it commits and of every earlier one not sent yet. `forced_drafts`: a
        constrained session's fused generation verifies the tokens its grammar forces as it goes."""
        with session.lock:
            if round_number == session.last_round and session.last_result is not None:
                return session.last_result  # a retried round commits nothing twice
            if round_number != session.last_round + 1:
                raise StaleSession(f"round {round_number} out of order: the session's last round was {session.last_round}")
            self.check_sizes(len(tree), len(tree.parent), fused_tokens)
            try:
                tree.validate(self.vocab_size)
            except MalformedTree as err:
                raise RequestError(str(err)) from None
            if steering and self.steering is None:
                raise RequestError(
                    "steering was asked for, but this verifier has no steering checkpoint loaded (the config's steering_checkpoint)"
                )
            if verifier_state and self.fuse is None:
                raise RequestError(
                    "verifier_state was asked for, but this verifier fills none: it has no feature head checkpoint loaded "
                    "(a feature-head drafter's directory)"
                )
            if len(session.tokens) + len(tree) + max(fused_tokens, 1) > self.max_context:
                raise PastContext(f"the session would exceed the model's context of {self.max_context} tokens")
            check_kv_room(len(session.tokens) + len(tree) + max(fused_tokens, 1), self.kv_bytes_per_token, self.limits)
            start = time.perf_counter()
            session.passes, session.grammar_ms, session.forced = [], 0.0, [0, 0]
            features_start = session.num_cached
            # The residual-stream depths the round reads: all of them to steer, the fused three for features.
            fuse = verifier_state or session.keep_features
            depths = tuple(range(self.model.config.num_hidden_layers + 1)) if steering else tuple(self.fuse.layers) if fuse else ()
            if len(tree) == 0:
                new_tokens, read = yield from self._generate(session, max(fused_tokens, 1), depths, forced_drafts)
                num_accepted = 0
            else:
                new_tokens, read = yield from self._verify_tree(session, tree, depths)
                num_accepted = len(new_tokens) - 1
            # (Jobs run under inference mode: run_alone and the Batcher see to it.)
            steering_start = time.perf_counter()
            vector = vector_to_tensor_fields(self.steering(_at(read, -1))) if steering else None
            steering_ms = (time.perf_counter() - steering_start) * 1e3
            features_begun = time.perf_counter()
            depth_rows = torch.stack([read[depths.index(i)] for i in self.fuse.layers], dim=-2) if fuse else None
            fused = None
            if session.keep_features:
                self._keep_features(session, features_start, depth_rows, fuse_now=verifier_state)
                if verifier_state and session.features_sent < len(session.feature_rows):
                    fused = features_to_state(session.features_sent, torch.stack(session.feature_rows[session.features_sent :]))
                    session.features_sent = len(session.feature_rows)
            elif verifier_state:
                fused = features_to_state(features_start, self.fuse.fuse_depths(depth_rows))
            features_ms = (time.perf_counter() - features_begun) * 1e3
            compute_ms = (time.perf_counter() - start) * 1e3
            session.tokens.extend(new_tokens)
            passes = max(len(session.passes), 1)
            result = RoundResult(
                token_ids=new_tokens, num_accepted=num_accepted, committed_length=len(session.tokens), compute_ms=compute_ms,
                steering=vector, steering_ms=steering_ms, verifier_state=fused, verifier_state_ms=features_ms,
                batch_rows=sum(p.rows for p in session.passes) / passes, batch_sessions=sum(p.sessions for p in session.passes) / passes,
                grammar_ms=session.grammar_ms, forced_drafted=session.forced[0], forced_accepted=session.forced[1],
            )
            session.last_round, session.last_result = round_number, result
            return result

    # Kept features are fused in batches of this many rows, or when asked for. Unfused rows cost
    # 6.9 KB a position (three float32 depths) against ~23 KB of KV cache. At 256, an adaptive
    # session under load fused a long prompt's rows (2.6 ms of the pass for 256) though no
    # round asked for them.
    FUSE_EVERY = 1024

    def _keep_features(self, session: VerifierSession, start: int, depth_rows: torch.Tensor, fuse_now: bool) -> None:
        """Keeps the features of positions [start, start + len(depth_rows)): a re-fed position's
        replaces its old one. The fusing (a matrix product on the compute thread, which every
        session in the pass waits for) waits until the features are asked for (a drafting round
        is next) or FUSE_EVERY rows have gathered: a session the verifier alone decodes to its
        end, as under load, never pays it; the depths wait as they are, 3x a fused row's bytes."""
        done = len(session.feature_rows)
        if start < done:
            del session.feature_rows[start:]
            session.unfused = []
        elif session.unfused:
            keep = start - done  # rows of positions before `start`
            chunks, session.unfused = session.unfused, []
            for chunk in chunks:
                if keep > 0:
                    session.unfused.append(chunk[:keep])
                    keep -= len(chunk)
        session.unfused.append(depth_rows)
        if fuse_now or sum(len(chunk) for chunk in session.unfused) >= self.FUSE_EVERY:
            pending = torch.cat(session.unfused) if len(session.unfused) > 1 else session.unfused[0]
            session.feature_rows.extend(self.fuse.fuse_depths(pending).to(torch.float16).unbind(0))
            session.unfused = []
        session.features_sent = min(session.features_sent, start)

    def _forward(self, session: VerifierSession, input_ids: list[int], num_logits: int, depths: tuple[int, ...], **masking) -> Job:
        """(logits of the last num_logits positions, the hidden states at `depths` (indices into
        transformers' output_hidden_states) or None without depths)."""
        output, size = yield ForwardCall(session.cache, input_ids, num_logits, hidden_states=depths, **masking)
        session.passes.append(size)
        return output

    def _choose(self, session: VerifierSession, logits: torch.Tensor, position: int) -> int:
        """The verifier's token after one row of logits (constrained: among those its grammar allows)."""
        if session.grammar is not None:
            start = time.perf_counter()
            logits = mask_rows(logits, session.grammar.allowed())
            session.grammar_ms += (time.perf_counter() - start) * 1e3
        if session.sampling.greedy:
            token = greedy_tokens(logits)[0]
        else:
            token = sample(warp_probs(logits, session.sampling), position_generator(session.sampling.seed, position))
        if session.grammar is not None:
            session.grammar.advance([token])
        return token

    def _generate(self, session: VerifierSession, max_tokens: int, depths: tuple[int, ...], forced_drafts: bool = False) -> Job:
        """The new tokens, and the hidden states at `depths` of the positions read, all of which
        are committed (None without depths). With `forced_drafts` (a constrained session, no
        depths), a pass also feeds the tokens the grammar forces next, verified as a chain, and
        the generation ends after the first pass that kept some."""
        new: list[int] = []
        prefilled = yield from self._prefill(session, depths)
        read = [tuple(h[0] for h in prefilled)] if prefilled else []
        pending = session.tokens[session.num_cached :]
        while len(new) < max_tokens:
            forced = session.grammar.forced(max_tokens - len(new) - 1) if forced_drafts and session.grammar and not depths else []
            if forced:
                chosen = yield from self._verify_forced(session, pending, forced, len(session.tokens) + len(new))
            else:
                logits, states = yield from self._forward(session, pending, 1, depths)
                if depths:
                    read.append(tuple(h[0] for h in states))
                chosen = [self._choose(session, logits[-1], len(session.tokens) + len(new))]
            ended = next((i for i, token in enumerate(chosen) if token in self.eos_ids), None)
            new += chosen if ended is None else chosen[: ended + 1]
            # After structure the grammar forced comes text a drafter may copy (a key's value): the
            # call ends there, and the next round drafts.
            if ended is not None or len(chosen) > 1:
                break
            pending = chosen[-1:]
        return new, tuple(torch.cat(layer) for layer in zip(*read)) if depths else None

    def _verify_forced(self, session: VerifierSession, pending: list[int], forced: list[int], position: int) -> Job:
        """Feeds `pending` and the grammar's `forced` tokens in one pass and keeps the longest
        part of them the constrained verifier accepts, then its own next token (which it returns
        with them); the grammar follows them."""
        chain = DraftTree(list(forced), list(range(-1, len(forced) - 1)))
        committed_len = session.num_cached + len(pending)
        logits, _ = yield from self._forward(session, pending + forced, len(forced) + 1, ())
        path, next_token = self._accept(session, chain, logits, position)
        session.cache.keep_positions(committed_len, [committed_len + node for node in path])
        chosen = [forced[node] for node in path] + [next_token]
        session.grammar.advance(chosen)
        session.forced[0] += len(forced)
        session.forced[1] += len(path)
        return chosen

    def _accept(self, session: VerifierSession, tree: DraftTree, logits: torch.Tensor, position: int) -> tuple[list[int], int]:
        """The accepted path of `tree` and the verifier's next token, from a pass's logits (row 0:
        after the committed context, at `position`; row 1 + i: after node i), each row masked by
        its own path's grammar state where the session is constrained."""
        if session.grammar is not None:
            start = time.perf_counter()
            logits = mask_tree_rows(logits, tree, session.grammar)
            session.grammar_ms += (time.perf_counter() - start) * 1e3
        if session.sampling.greedy:
            return accept_greedy(tree, greedy_tokens(logits))
        return accept_sampled(tree, warp_probs(logits, session.sampling), position_generator(session.sampling.seed, position))

    def _verify_tree(self, session: VerifierSession, tree: DraftTree, depths: tuple[int, ...]) -> Job:
        """The new tokens, and the hidden states at `depths` of the positions committed: the pending
        tokens and the accepted path; the last one gave the new token."""
        prefilled = yield from self._prefill(session, depths)
        num_cached = session.num_cached
        pending = session.tokens[num_cached:]
        positions, mask = verification_inputs(tree, num_cached, len(pending))
        logits, states = yield from self._forward(
            session,
            pending + tree.token_ids,
            len(tree) + 1,
            depths,
            position_ids=positions,
            attention_mask=mask,
        )
        path, next_token = self._accept(session, tree, logits, len(session.tokens))  # the round's first new position
        committed_len = num_cached + len(pending)
        session.cache.keep_positions(committed_len, [committed_len + node for node in path])
        committed = list(range(len(pending))) + [len(pending) + node for node in path]
        if session.grammar is not None:
            session.grammar.advance([tree.token_ids[node] for node in path] + [next_token])
        read = None if states is None else tuple(h[0, committed] for h in states)
        if prefilled:
            read = tuple(torch.cat([before[0], after]) for before, after in zip(prefilled, read))
        return [tree.token_ids[node] for node in path] + [next_token], read

    def _prefill(self, session: VerifierSession, depths: tuple[int, ...]) -> Job:
        """Feeds the prompt but its last token into a new session's cache in one fast pass (the
        same pass whichever way the session decodes), after the longest prefix of it that the
        prefix cache holds; returns the hidden states at `depths` of those positions when asked
        for, else None."""
        prompt = session.tokens[: session.prompt_length - 1]
        if session.num_cached or not prompt:
            return None
        cached = self.prefix is not None and set(depths) <= set(self.prefix.depths)
        if not cached:
            (_, states), size = yield ForwardCall(session.cache, prompt, 1, hidden_states=depths, prefill=True)
            session.passes.append(size)
            return states
        blocks = self.prefix.match(prompt)
        every = self.prefix.load(blocks, session.cache) if blocks else None  # one tensor per depth the cache keeps
        start = len(blocks) * BLOCK_TOKENS
        if start < len(prompt):
            (_, states), size = yield ForwardCall(session.cache, prompt[start:], 1, hidden_states=self.prefix.depths)
            session.passes.append(size)
            read = tuple(h[0] for h in states or ())
            every = read if every is None else tuple(torch.cat(pair) for pair in zip(every, read))
        self.prefix.store(prompt, session.cache, every)
        self.prefix.count(start, len(prompt) - start)
        return tuple(every[self.prefix.depths.index(d)][None] for d in depths) if depths else None


def _at(hidden_states: tuple, position: int) -> tuple:
    """Every layer's hidden state at one of the positions read."""
    return tuple(h[position] for h in hidden_states)

