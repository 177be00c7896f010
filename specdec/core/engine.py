"""The engine both services run their model through, and the weight formats it serves.

`float32`, `bfloat16` and `float16` are transformers' own modules in that dtype (float32 is
exactly what `generate()` runs); `int8` (specdec/core/int8.py) replaces every linear layer of
the decoder and the LM head; `q4_0`, `q4_1` and `q8_0` (specdec/core/blocks.py) keep the decoder's linears
as GGUF's blocks and the LM head int8; `gguf` (specdec/core/kquants.py) serves a GGUF file's
K-quant linears and LM head as the file stores them, each tensor in its own format. `LlamaEngine` runs Llama-family decoders itself:
with int8, block or K-quant weights on a CPU each layer is one call of the native kernel, and every row of a pass (tree nodes,
other sessions' tokens) gets exactly what it would alone. Other models run through
`TransformersEngine`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.core.cuda_graphs import GraphRunner, cuda_graphs_enabled
from specdec.core.int8 import NativeLayer, fused_linear, native_layer
from specdec.core.blocks import BLOCK_FORMATS
from specdec.core.kernels import native
from specdec.core.kv_cache import KVCache, TransformersCache

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", *BLOCK_FORMATS, "gguf")
QUANTIZED = ("int8", *BLOCK_FORMATS, "gguf")  # formats whose linears multiply integers (int8.py, blocks.py, kquants.py)


def torch_dtype(weights: str) -> torch.dtype:
    """The dtype the model's own tensors (those not quantized) are kept in."""
    return torch.float32 if weights in QUANTIZED else getattr(torch, weights)


@dataclass
class ForwardCall:
    """One sequence's part of a forward pass: `input_ids` fed after the tokens its cache holds
    (the arguments of LlamaEngine.forward)."""

    cache: KVCache | TransformersCache
    input_ids: list[int]
    num_logits: int = 1
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    hidden_states: bool | tuple[int, ...] = False  # True: every depth; a tuple: those depths, in that order
    prefill: bool = False


def depths_of(hidden_states: bool | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The residual-stream depths asked for (indices into transformers' output_hidden_states:
    0 = the embeddings, num_layers = after the final norm)."""
    if hidden_states is True:
        return tuple(range(num_layers + 1))
    return tuple(hidden_states or ())


class RotaryTable:
    """A rotary embedding module's cos/sin rows at given positions, read from a table grown by
    doubling: the module costs ~40 µs a call, a sixth of a served 5-token verify. Each row is
    position x frequency elementwise, so a table row equals what a call would give."""

    def __init__(self, rotary: torch.nn.Module, like: torch.Tensor):
        self.rotary, self.like = rotary, like[:1]
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(len(positions), head_dim) cos and sin."""
        if getattr(self.rotary, "rope_type", "default") not in ("default", "linear", "llama3"):
            cos, sin = self.rotary(self.like, positions.to(self.like.device)[None])  # frequencies that move with length
            return cos[0], sin[0]
        needed = int(positions.max()) + 1
        if self.table is None or needed > self.table[0].shape[0]:
            size = max(needed, 2 * (0 if self.table is None else self.table[0].shape[0]), 256)
            cos, sin = self.rotary(self.like, torch.arange(size, device=self.like.device)[None])
            self.table = (cos[0], sin[0])
        cos, sin = self.table
        return cos[positions], sin[positions]


class LlamaEngine(torch.nn.Module):
    """A Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral without a sliding window) run by
    one short forward of its own: fused q|k|v and gate|up layers, the model's own rotary
    embedding, an in-place KV cache, logits only where asked. It reads the
    weights of a transformers model (its linears may be Int8Linear) and gives the same
    results as that model up to float rounding."""

    SUPPORTED = ("llama", "qwen2", "mistral")

    def __init__(self, model: torch.nn.Module, cuda_graphs: bool = True):
        super().__init__()
        config = model.config
        if not self.supports(model):
            raise ValueError(f"LlamaEngine does not run model type '{config.model_type}'")
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = torch.nn.ModuleList()
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            block = torch.nn.Module()
            block.input_norm, block.post_norm = layer.input_layernorm, layer.post_attention_layernorm
            block.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            block.o = attn.o_proj
            block.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj])
            block.down = mlp.down_proj
            self.layers.append(block)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.intermediate = config.intermediate_size
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # SD² steering: layer index -> delta added to the up-branch (None = none this forward).
        self.up_delta: Callable[[int], torch.Tensor | None] | None = None
        self.native_layers = self._native_layers(config)
        self.rotary_rows = RotaryTable(self.rotary, self.embed.weight)
        # On a GPU with bf16/float16 weights every pass but a prefill replays a CUDA graph at a
        # fixed shape: fast, and a row's result no longer depends on the pass (cuda_graphs.py).
        graphed = cuda_graphs and cuda_graphs_enabled() and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        self.graphs = GraphRunner(self) if graphed else None

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        config = model.config
        windowed = getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)
        return config.model_type in LlamaEngine.SUPPORTED and getattr(config, "hidden_act", "silu") == "silu" and not windowed

    def _native_layers(self, config) -> list[NativeLayer] | None:
        """Each layer's tensors for the native kernel, or None where it does not apply to all
        (other weight formats, no kernels, not CPU)."""
        if self._native_attention() is None:
            return None
        bundles = [native_layer(b.input_norm, b.qkv, b.o, b.post_norm, b.gate_up, b.down, config.rms_norm_eps) for b in self.layers]
        return None if any(b is None for b in bundles) else bundles

    @property
    def kv_bytes_per_token(self) -> int:
        return self.new_cache().bytes_per_token

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's results depend on its own sequence alone, whatever else a pass
        holds: the native layers. Cached rows of a prompt can then stand for a fresh read. (CUDA
        graphs of one row bucket are, as tests/test_cuda_graphs.py checks on a GPU, but a
        prompt's prefill runs eagerly there; with a prefix cache every prompt would be read in
        16-row graph passes instead, ~0.3 s for 1,000 tokens of the 1.5B coder on an H100.)"""
        return self.native_layers is not None

    def new_cache(self) -> KVCache:
        if self.graphs is not None:  # keys and values of bf16 projections, widened exactly in the graphs' buffers
            return KVCache(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype, self.device)
        native_attention = self._native_attention() is not None
        # Without the native kernel attention runs in float64 (see _attention); keys and values
        # are kept in it, converted once when written rather than at every step. The native
        # layers keep them in 16 bits: attention over many sessions is bound by reading their
        # caches, and their int8 activations are far coarser than a 16-bit rounding. bfloat16
        # where the CPU multiplies it (twice the products per instruction of float32), else float16.
        if self.native_layers is not None:
            dtype = getattr(torch, native().cache_dtype())
        else:
            dtype = torch.float32 if native_attention else torch.float64
        return KVCache(len(self.layers), self.num_kv_heads, self.head_dim, dtype, self.device, transposed_keys=native_attention)

    def _native_attention(self):
        """The native kernel's batch-invariant float32 attention (CPU), or None."""
        return native() if self.device.type == "cpu" else None

    def forward(
        self,
        cache: KVCache,
        input_ids: list[int],
        num_logits: int = 1,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        hidden_states: bool | tuple[int, ...] = False,
        prefill: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Feeds `input_ids` after the cached tokens: (logits of the last `num_logits` positions,
        float32; the residual stream after each layer as transformers' output_hidden_states
        gives it, or None; `hidden_states` a tuple of depths: only those, in that order).
        Without a mask every token sees the cache and the tokens before it.
        `prefill` (an empty cache, no mask) lets the torch-ops path run torch's attention kernels:
        many times faster on long prompts, but a token's result then depends on the pass, so only
        a prefix that every way of decoding feeds in the same single pass may take it (a
        session's prompt). The native layers are batch-invariant and need no such care."""
        return self.forward_many([ForwardCall(cache, input_ids, num_logits, position_ids, attention_mask, hidden_states, prefill)])[0]

    def forward_many(self, calls: list[ForwardCall]) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]]:
        """Several sequences' forwards, each over its own cache: what `forward` returns for each.
        The native layers run them all in one pass (the weights are read once): a row's result
        depends on its own sequence alone, so each gets exactly what it would get alone. The
        torch-ops path runs them one after another, as its kernels' sums change with the batch."""
        for call in calls:
            start = call.cache.length
            if call.prefill and (start or call.attention_mask is not None or call.position_ids is not None):
                raise ValueError("prefill feeds a prompt into an empty cache, causally")
            call.cache.reserve(start + len(call.input_ids))
        if self.native_layers is None:
            return [self.graphs.forward(call, depths_of(call.hidden_states, len(self.layers)))
                    if self._graphed(call) else self._torch_forward(call)
                    for call in calls]
        return self._native_forward(calls) if calls else []

    def _graphed(self, call: ForwardCall) -> bool:
        """A prompt's prefill (torch's attention kernels, once per session) and a steered pass
        (SD²'s deltas) run eagerly; every other pass on a GPU replays a graph."""
        return self.graphs is not None and not call.prefill and self.up_delta is None

    def _native_forward(self, calls: list[ForwardCall]) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]]:
        starts, counts = [c.cache.length for c in calls], [len(c.input_ids) for c in calls]
        positions = torch.cat([
            torch.arange(start, start + count) if c.position_ids is None else c.position_ids[0]
            for c, start, count in zip(calls, starts, counts)
        ])
        x = self.embed(torch.tensor([t for c in calls for t in c.input_ids]))
        cos, sin = self.rotary_rows(positions)
        masks = [None if c.attention_mask is None else c.attention_mask[0, 0] for c in calls]
        depths = [depths_of(c.hidden_states, len(self.layers)) for c in calls]
        wanted = set().union(*depths)
        keep = {0: x} if 0 in wanted else {}  # depth -> the residual stream there, all rows
        keys, values = zip(*(c.cache.by_layer for c in calls))
        for index, layer in enumerate(self.native_layers):
            delta = self.up_delta(index) if self.up_delta is not None else None
            x = layer(x, cos, sin, [k[index] for k in keys], [v[index] for v in values], starts, counts, masks, self.num_heads, delta)
            if index + 1 in wanted:
                keep[index + 1] = x
        normed = self.norm(x)
        if len(self.layers) in wanted:
            keep[len(self.layers)] = normed
        ends = torch.tensor(counts).cumsum(0).tolist()
        rows = torch.cat([torch.arange(end - c.num_logits, end) for c, end in zip(calls, ends)])
        logits = self.lm_head(normed[rows]).float().split([c.num_logits for c in calls])
        results = []
        for call, start, count, end, call_logits, call_depths in zip(calls, starts, counts, ends, logits, depths):
            call.cache.length = start + count
            states = tuple(keep[d][end - count : end][None] for d in call_depths) if call_depths else None
            results.append((call_logits, states))
        return results

    def _torch_forward(self, call: ForwardCall) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        cache, count, start = call.cache, len(call.input_ids), call.cache.length
        position_ids = torch.arange(start, start + count)[None] if call.position_ids is None else call.position_ids
        x = self.embed(torch.tensor(call.input_ids, device=self.device))
        cos, sin = self.rotary_rows(position_ids.to(self.device)[0])
        cos, sin = cos[:, None], sin[:, None]  # (count, 1, head_dim): one row per token
        mask = None if call.attention_mask is None else call.attention_mask[0, 0].to(self.device)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        depths = depths_of(call.hidden_states, len(self.layers))
        keep = [x[None]] if depths else None
        for index, block in enumerate(self.layers):
            delta = self.up_delta(index) if self.up_delta is not None else None
            qkv = block.qkv(block.input_norm(x))
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rotate(q.view(count, heads, dim), cos, sin)
            k = _rotate(k.view(count, kv_heads, dim), cos, sin)
            v = v.view(count, kv_heads, dim)
            keys, values = cache.keys[index], cache.values[index]
            if cache.transposed_keys:
                keys[:, :, start : start + count] = k.permute(1, 2, 0)
            else:
                keys[:, start : start + count] = k.transpose(0, 1)
            values[:, start : start + count] = v.transpose(0, 1)
            if call.prefill:
                attended = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
                ).transpose(0, 1)
            else:
                attended = self._attend(q, keys, values, start, count, mask)
            x = x + block.o(attended.reshape(count, self.q_size).to(x.dtype))
            gate, up = block.gate_up(block.post_norm(x)).split(self.intermediate, dim=-1)
            if delta is not None:
                up = up + delta.to(up.dtype)
            x = x + block.down(torch.nn.functional.silu(gate) * up)
            if keep is not None:
                keep.append(x[None])
        cache.length = start + count
        normed = self.norm(x)
        if keep is not None:
            keep[-1] = normed[None]
        logits = self.lm_head(normed[-call.num_logits :])
        return logits.float(), None if keep is None else tuple(keep[d] for d in depths)

    def _attend(self, q, keys, values, start: int, count: int, mask: torch.Tensor | None) -> torch.Tensor:
        kernels = self._native_attention()
        if kernels is not None:
            return kernels.attention(q.float(), keys, values, start + count, start, mask)
        return _attention(q, keys[:, : start + count], values[:, : start + count], start, mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q (T, heads, d) over keys/values (kv_heads, S, d) without the native
    kernel, computed in float64 so that a token's result does not depend on how many queries
    share the pass: float32 kernels sum in an order that does, and int8 activations downstream
    would turn that last-bit noise into different tokens. Query heads that share a key/value
    head are stacked (no copies)."""
    kv_heads, length, dim = keys.shape
    count, heads = q.shape[0], q.shape[1]
    groups = heads // kv_heads
    queries = q.double().permute(1, 0, 2).reshape(kv_heads, groups * count, dim)
    scores = torch.bmm(queries, keys.double().transpose(1, 2)) * dim**-0.5
    if mask is None and count > 1:  # one query sees every key: no mask
        mask = torch.ones(count, length, dtype=torch.bool, device=q.device).tril(start)
    if mask is not None:
        scores.masked_fill_(~mask.repeat(groups, 1), float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), values.double())
    return out.view(heads, count, dim).transpose(0, 1)


class TransformersEngine:
    """Any transformers causal LM run by its own forward: exactly what `generate()` runs."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def new_cache(self) -> TransformersCache:
        return TransformersCache(config=self.model.config)

    @property
    def kv_bytes_per_token(self) -> int:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * self.model.dtype.itemsize

    batch_invariant = False  # its kernels' sums change with the pass

    def __call__(
        self,
        cache: TransformersCache,
        input_ids: list[int],
        num_logits: int = 1,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        hidden_states: bool | tuple[int, ...] = False,
        prefill: bool = False,  # transformers' forward is its own prefill
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        device = self.model.device
        out = self.model(
            input_ids=torch.tensor([input_ids], device=device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=num_logits,
            output_hidden_states=bool(hidden_states),
            position_ids=None if position_ids is None else position_ids.to(device),
            attention_mask=None if attention_mask is None else attention_mask.to(device),
        )
        depths = depths_of(hidden_states, self.model.config.num_hidden_layers)
        return out.logits[0].float(), tuple(out.hidden_states[d] for d in depths) if depths else None

    def forward_many(self, calls: list[ForwardCall]) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]]:
        """One after another: transformers' kernels would change a sequence's sums with the batch."""
        return [self(c.cache, c.input_ids, c.num_logits, c.position_ids, c.attention_mask, c.hidden_states, c.prefill) for c in calls]


def engine_for(model: torch.nn.Module, weights: str) -> LlamaEngine | TransformersEngine:
    """float32 runs as transformers runs it (so output equals `generate()`); the other formats
    run the engine's own forward where the architecture allows."""
    if weights != "float32" and LlamaEngine.supports(model):
        return LlamaEngine(model)
    return TransformersEngine(model)
