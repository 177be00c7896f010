"""The model drafter: a small causal LM whose KV cache follows the committed context, drafting
greedy picks or samples with their sparse proposal, optionally steered by the verifier's SD²
vector, and with staged speculation: an n-gram second stage guesses the drafter's own next
tokens, which it checks in the forward it runs anyway (right guesses save forwards; the draft
is unchanged)."""
from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from drafter_service.distributions import likeliest, next_tokens
from drafter_service.drafting import Drafter, DrafterInfo, DrafterSession, ScoredTree, grammar_masks
from drafter_service.tree_builders import NextToken, builder_for
from specdec.core.batching import Job
from specdec.core.engine import ForwardCall, LlamaEngine, engine_for
from specdec.core.grammar import Grammars
from specdec.core.kv_cache import KVCache, TransformersCache, cache_nbytes
from specdec.core.models import (
    ModelSpec,
    check_tree_attention,
    eos_token_ids,
    load_model,
    load_tokenizer,
    max_context,
    tokenizer_fingerprint,
)
from specdec.core.ngram import NgramLM, NgramProposer, OwnChoices
from specdec.core.sampling import Sampling
from specdec.core.steering import load_drafter_steering
from specdec.core.tree import ROOT, DraftTree, TreeShape, node_inputs, verification_inputs


@dataclass
class ModelState:
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
    own: OwnChoices | None = None  # staged speculation: the drafter's own choices so far
    deltas: list[torch.Tensor] | None = None  # the running draft's SD² steering, per layer


@dataclass
class DraftForward:
    """A forward a draft job asks for: the engine's call, and the SD² steering every token it
    feeds gets (None = unsteered). Steered forwards run alone: steering is the model's state."""

    call: ForwardCall
    deltas: list[torch.Tensor] | None = None


class ModelDrafter(Drafter):
    """`stage2`: the n-gram method of staged speculation, guessing `lookahead` tokens per
    forward (None = off); `shared_choices`: the drafter's own choices remembered across
    requests (None: each session its own)."""

    def __init__(
        self, spec: ModelSpec, proposal_top_k: int = 32, steering_checkpoint: str | None = None,
        stage2: NgramProposer | None = None, lookahead: int = 0, shared_choices: OwnChoices | None = None,
    ):
        self.proposal_top_k, self.stage2, self.lookahead, self.shared_choices = proposal_top_k, stage2, lookahead, shared_choices
        tokenizer = load_tokenizer(spec.source)
        self.model = load_model(spec)
        self.steering, steering_fingerprint = None, ""
        if steering_checkpoint:
            self.steering, steering_fingerprint = load_drafter_steering(steering_checkpoint, self.model)
        self.draft_vocab = getattr(self.model.get_output_embeddings(), "vocab_ids", None)
        self.vocab_size = len(tokenizer)
        self.engine = engine_for(self.model, self.model.weight_format)
        if self.steering and isinstance(self.engine, LlamaEngine):
            self.engine.up_delta = self.steering.delta  # transformers' modules get theirs through hooks
        check_tree_attention(self.engine, self.model.config)
        self.grammars = Grammars(tokenizer, self.model.config.vocab_size, eos_token_ids(self.model, tokenizer))
        self.info = DrafterInfo(
            self.model, self.vocab_size, tokenizer_fingerprint(tokenizer), eos_token_ids(self.model, tokenizer), max_context(self.model),
            self.engine.kv_bytes_per_token, self.steering.norm.normalized_shape[0] if self.steering else 0, steering_fingerprint,
            weight_format=self.model.weight_format,
        )

    def new_state(self, context: list[int], sampling: Sampling) -> ModelState:
        return ModelState(self.engine.new_cache(), own=self.shared_choices or OwnChoices())

    def state_bytes(self, state: ModelState) -> int:
        return cache_nbytes(state.cache)

    def begin_round(self, session: DrafterSession, steering: torch.Tensor | None) -> float:
        """Makes the per-layer deltas of `steering`, which every forward of the round adds."""
        state = session.state
        state.reuse_guesses = steering is None and not state.fed_steered
        state.fed_steered = steering is not None
        if steering is None:
            return 0.0
        start = time.perf_counter()
        state.deltas = list(self.steering.deltas(steering.to(self.model.device)).unbind(-2))
        return (time.perf_counter() - start) * 1e3

    def end_round(self, session: DrafterSession) -> None:
        session.state.deltas = None

    def forward_many(self, forwards: list[DraftForward]) -> list[Any]:
        """The unsteered forwards in one pass of the engine, each steered one alone."""
        plain = [i for i, f in enumerate(forwards) if f.deltas is None]
        results: list[Any] = [None] * len(forwards)
        for i, result in zip(plain, self.engine.forward_many([forwards[i].call for i in plain])):
            results[i] = result
        for i in (i for i, f in enumerate(forwards) if f.deltas is not None):
            with self.steering.applied(forwards[i].deltas):
                results[i] = self.engine.forward_many([forwards[i].call])[0]
        return results

    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> Job:
        logits = yield from self._feed_context(session, context)
        return likeliest(logits[0], self.draft_vocab, excludes)

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        state = session.state
        fed = self._guess(session, context)
        logits = yield from self._feed_context(session, context, fed)
        num_context = len(state.cached_tokens)
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
                    state.own.record(before, tree.token_ids[node])
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
                out = yield from self._forward(
                    session, [fed.token_ids[n] for n in new], len(new), position_ids=positions, attention_mask=mask
                )
                logits_of.update(zip(new, out))
            return next_tokens(
                torch.stack([logits_of[fed_node[n]] for n in nodes]), session.sampling, self.draft_vocab, self.proposal_top_k,
                grammar_masks(session, tree, nodes),
            )

        rescore = None
        if shape.method == "lattice-ngram":
            lm, tail = NgramLM(session.ngram), context[-session.ngram.max_n :]

            def rescore(path: list[int], candidates: list[tuple[int, float]]) -> list[float]:
                # An even mixture: where the context says nothing, the drafter's ranking stands.
                probs = lm.probs(tail + path, [token for token, _ in candidates])
                return [math.log(0.5 * math.exp(logq) + 0.5 * p) for (_, logq), p in zip(candidates, probs)]
        generator = None if session.sampling.greedy else session.generator
        tree = yield from builder_for(shape, rescore).build(expand, budget, generator)
        state.fed_expanded = set(fed_node.values()) - {ROOT}
        return ScoredTree(tree, [])

    def _forward(self, session: DrafterSession, input_ids: list[int], num_logits: int = 1, **masking) -> Job:
        session.forward_passes += 1
        logits, _ = yield DraftForward(ForwardCall(session.state.cache, input_ids, num_logits, **masking), session.state.deltas)
        return logits[:, : self.vocab_size] if self.draft_vocab is None else logits[:, self.draft_vocab]

    def _reuse_cache(self, state: ModelState, context: list[int]) -> list[int]:
        """Keeps the cached tokens that still match `context` and the fed nodes along the path
        that was committed; returns the context tokens still to feed (at least the last one)."""
        keep = 0
        limit = min(len(state.cached_tokens), len(context) - 1)
        while keep < limit and state.cached_tokens[keep] == context[keep]:
            keep += 1
        if keep < len(state.cached_tokens):  # a wrong assumption, or drafting again without a commit
            state.cache.truncate(keep)
            del state.cached_tokens[keep:]
            state.fed_tree = DraftTree()
        prefix = len(state.cached_tokens)
        new = context[prefix:]
        tree, kept, node = state.fed_tree, [], ROOT
        reusable = lambda c: state.reuse_guesses or c in state.fed_expanded  # noqa: E731
        for token in new[:-1]:
            node = next((c for c in tree.children(node) if tree.token_ids[c] == token and reusable(c)), None)
            if node is None:
                break
            kept.append(prefix + node)
        state.cache.keep_positions(prefix, kept)
        state.cached_tokens.extend(new[: len(kept)])
        return new[len(kept) :]

    def _feed_context(self, session: DrafterSession, context: list[int], guess: DraftTree | None = None) -> Job:
        """Brings the cache up to `context`, then feeds `guess` (a tree after it) in the same
        forward; returns the logits of the token after the context, then after each guess node."""
        state = session.state
        pending = self._reuse_cache(state, context)
        if guess:
            positions, mask = verification_inputs(guess, len(state.cached_tokens), len(pending))
            logits = yield from self._forward(
                session, pending + guess.token_ids, 1 + len(guess), position_ids=positions, attention_mask=mask
            )
        else:
            logits = (yield from self._forward(session, pending))[-1:]
        state.cached_tokens.extend(pending)
        state.fed_tree = DraftTree() if guess is None else guess  # the same object the builder grows
        return logits

    def _guess(self, session: DrafterSession, tail: list[int]) -> DraftTree:
        """The second stage's guess of what the drafter drafts after `tail`: what it drafted
        before after the same tokens (in any session, with memory across requests; Katz-style
        back-off from three tokens to one), else what followed them in the context."""
        if not self.stage2:
            return DraftTree()
        own = session.state.own.guess(tail, self.lookahead)
        if not own:
            return self.stage2.propose(session.ngram, tail, self.lookahead, self.lookahead).tree
        return DraftTree(own, list(range(-1, len(own) - 1)))
