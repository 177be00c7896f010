"""The drafter that reads the verifier's features (specdec/core/feature_head.py), EAGLE-3
style: a peer of the model drafter, with the same tree builders and the head in place of a model.

The head's cache holds one entry per position. Committed positions are fed from the
verifier's features as they arrive; whatever follows them (assumed tokens, draft nodes)
reads the head's own output of the position before, and is dropped once the verifier
commits: its committed features replace the head's guesses."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from drafter_service.distributions import likeliest, next_tokens
from drafter_service.drafting import Drafter, DrafterInfo, DrafterSession, ScoredTree, VerifierState
from drafter_service.tree_builders import builder_for
from specdec.core.batching import Job
from specdec.core.engine import RotaryTable
from specdec.core.errors import RequestError, StaleSession
from specdec.core.int8 import fused_linear, native_layer, quantize_linears
from specdec.core.feature_head import FeatureHeadError, features_from_state, load_feature_head, state_name
from specdec.core.kv_cache import KVCache
from specdec.core.models import ModelSpec, eos_token_ids, load_tokenizer, max_context, tokenizer_fingerprint
from specdec.core.sampling import Sampling
from specdec.core.tree import ROOT, DraftTree, TreeShape, node_inputs


@dataclass
class HeadForward:
    """Entries fed after a session's head cache: tokens, the feature each reads (the
    verifier's, or the head's own output at the position before), positions (1, T), and the
    attention mask (1, 1, T, cache + T; None = causal)."""

    cache: KVCache
    tokens: list[int]
    features: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class FeatureState:
    cache: KVCache
    features: torch.Tensor | None = None  # (capacity, H): the verifier's feature of each position
    num_features: int = 0
    committed_entries: int = 0  # cache entries fed from verifier features (positions 0..n-1)
    committed_output: torch.Tensor | None = None  # the head's output at the last committed position
    extra: list[int] = field(default_factory=list)  # tokens fed after the committed ones (assumed, picked)
    extra_outputs: list[torch.Tensor] = field(default_factory=list)


class FeatureDrafter(Drafter):
    def __init__(self, spec: ModelSpec, proposal_top_k: int = 32):
        self.proposal_top_k = proposal_top_k
        tokenizer = load_tokenizer(spec.source)
        self.head, base = load_feature_head(spec.source)
        if spec.dtype == "int8":  # the head is memory-bound: int8 weights draft about 3x faster
            quantize_linears(self.head)
        elif spec.dtype != "float32":
            raise ValueError(f"a feature head runs float32 or int8 weights, not {spec.dtype}")
        layer = self.head.layer
        # int8 on a CPU: the decoder layer runs whole in the engine's native kernel.
        self.native_layer = native_layer(layer.input_norm, fused_linear([layer.q, layer.k, layer.v]), layer.o, layer.post_norm,
                                         fused_linear([layer.gate, layer.up]), layer.down, layer.input_norm.eps)
        self.rotary_rows = RotaryTable(self.head.rotary, self.head.embed.weight)
        self.draft_vocab = self.head.vocab_ids
        self.feature_size = self.head.hidden_size
        self.info = DrafterInfo(
            self.head, len(tokenizer), tokenizer_fingerprint(tokenizer), eos_token_ids(base, tokenizer), max_context(base),
            self._new_cache().bytes_per_token, verifier_state=state_name(spec.source), weight_format=spec.dtype,
        )

    def new_state(self, context: list[int], sampling: Sampling) -> FeatureState:
        return FeatureState(self._new_cache())

    def state_bytes(self, state: FeatureState) -> int:
        return state.cache.nbytes

    def _new_cache(self) -> KVCache:
        layer = self.head.layer
        return KVCache(1, layer.num_kv_heads, layer.head_dim, torch.float32, "cpu", transposed_keys=self.native_layer is not None)

    def take_verifier_state(self, session: DrafterSession, verifier_state: VerifierState) -> None:
        """The verifier's features of positions start, start + 1, ..."""
        try:
            rows = features_from_state(verifier_state.positions, verifier_state.records, self.feature_size)
        except FeatureHeadError as err:
            raise RequestError(str(err)) from None
        state, start = session.state, verifier_state.start
        if start > state.num_features:
            raise StaleSession(
                f"verifier_state.start {start} leaves a gap: this session holds the features of positions [0, {state.num_features}); "
                "re-open it",
            )
        end = start + len(rows)
        if state.features is None or state.features.shape[0] < end:
            grown = torch.zeros(max(2 * end, 256), self.feature_size)
            if state.features is not None:
                grown[: state.num_features] = state.features[: state.num_features]
            state.features = grown
        state.features[start:end] = rows
        state.num_features = end
        # Entries fed from features that have just been replaced are fed again.
        state.committed_entries = min(state.committed_entries, start + 1)

    def forward_many(self, forwards: list[HeadForward]) -> list[torch.Tensor]:
        """The head over several sessions' entries: with the native layer, one pass (each
        session attends over its own cache); each forward's outputs (T, H)."""
        for f in forwards:
            f.cache.reserve(f.cache.length + len(f.tokens))
        if self.native_layer is None:
            outputs = [self._torch_run(f) for f in forwards]
        else:
            cos, sin = self.rotary_rows(torch.cat([f.positions[0] for f in forwards]))
            x = self.head.layer_input(torch.tensor([t for f in forwards for t in f.tokens]), torch.cat([f.features for f in forwards]))
            outputs = self.native_layer(
                x, cos, sin, [f.cache.keys[0] for f in forwards], [f.cache.values[0] for f in forwards], [f.cache.length for f in forwards],
                [len(f.tokens) for f in forwards], [None if f.mask is None else f.mask[0, 0] for f in forwards], self.head.layer.num_heads,
            ).split([len(f.tokens) for f in forwards])
        for f in forwards:
            f.cache.length += len(f.tokens)
        return list(outputs)

    def _torch_run(self, f: HeadForward) -> torch.Tensor:
        cache, start, count = f.cache, f.cache.length, len(f.tokens)
        past_keys, past_values = cache.keys[:, :, :start], cache.values[:, :, :start]
        outputs, keys, values = self.head(torch.tensor([f.tokens]), f.features[None], f.positions, past_keys, past_values, f.mask)
        cache.keys[0, :, start : start + count] = keys[0]
        cache.values[0, :, start : start + count] = values[0]
        return outputs[0]

    def _run(
        self, session: DrafterSession, tokens: list[int], features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> Job:
        """Feeds entries after the cache; the job's value is their outputs (T, H)."""
        session.forward_passes += 1
        return (yield HeadForward(session.state.cache, tokens, features, positions, mask))

    def _feed_committed(self, session: DrafterSession) -> Job:
        state, n = session.state, len(session.tokens)
        if state.committed_entries == n:
            return
        if state.num_features < n - 1:
            raise StaleSession(
                f"a feature head drafts after the verifier's features of every committed position but the last; "
                f"it has those of [0, {state.num_features}) and needs [0, {n - 1}): ask the verifier for features",
            )
        first = state.committed_entries
        state.cache.truncate(first)
        previous = torch.zeros(n - first, self.feature_size)
        rows = torch.arange(max(first, 1), n)
        if len(rows):
            previous[rows - first] = state.features[rows - 1]
        count = n - first
        mask = torch.ones(count, n, dtype=torch.bool).tril(first)[None, None]
        outputs = yield from self._run(session, session.tokens[first:], previous, torch.arange(first, n)[None], mask)
        state.committed_entries, state.committed_output = n, outputs[-1]
        state.extra, state.extra_outputs = [], []

    def _feed_context(self, session: DrafterSession, context: list[int]) -> Job:
        """Brings the cache up to `context` (committed tokens, then assumed ones each read with
        the head's output before it); the job's value is the head's output at the context's
        last position."""
        yield from self._feed_committed(session)
        state, n = session.state, len(session.tokens)
        extra = context[n:]
        keep = 0
        while keep < min(len(extra), len(state.extra)) and extra[keep] == state.extra[keep]:
            keep += 1
        state.cache.truncate(n + keep)
        del state.extra[keep:], state.extra_outputs[keep:]
        for token in extra[keep:]:
            before = state.extra_outputs[-1] if state.extra_outputs else state.committed_output
            position = n + len(state.extra)
            output = (yield from self._run(session, [token], before[None], torch.tensor([[position]]), None))[-1]
            state.extra.append(token)
            state.extra_outputs.append(output)
        return state.extra_outputs[-1] if state.extra_outputs else state.committed_output

    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> Job:
        last = yield from self._feed_context(session, context)
        return likeliest(self.head.logits(last[None])[0], self.draft_vocab, excludes)

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        root_output = yield from self._feed_context(session, context)
        root_logits = self.head.logits(root_output[None])
        num_context = session.state.cache.length
        fed: list[int] = []
        outputs: dict[int, torch.Tensor] = {ROOT: root_output}

        def expand(tree: DraftTree, nodes: list[int]) -> Job:
            new = [n for n in nodes if n != ROOT]
            rows = {ROOT: 0}
            logits = root_logits
            if new:
                positions, mask = node_inputs(tree, fed, new, num_context)
                before = torch.stack([outputs[tree.parent[n]] for n in new])
                out = yield from self._run(session, [tree.token_ids[n] for n in new], before, positions, mask)
                fed.extend(new)
                for i, node in enumerate(new):
                    outputs[node], rows[node] = out[i], 1 + i
                logits = torch.cat([root_logits, self.head.logits(out)])
            return next_tokens(logits[[rows[n] for n in nodes]], session.sampling, self.draft_vocab, self.proposal_top_k)

        generator = None if session.sampling.greedy else session.generator
        return ScoredTree((yield from builder_for(shape).build(expand, budget, generator)), [])
