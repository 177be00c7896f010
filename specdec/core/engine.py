"""The weight formats a served model runs in, and the int8 linear layer that makes verifying
a draft tree cost little more than one token on a CPU.

`float32`, `bfloat16` and `float16` are transformers' own modules in that dtype (float32 is
exactly what `generate()` runs). `int8` replaces every linear layer of the decoder and the LM
head by `Int8Linear`: weights int8 with one scale per output channel, activations int8 with
one scale per token, products summed in int32. Integer sums are exact, so a token's output
depends on that token alone and not on the other tokens in the same pass: a tree pass gives
each node the logits a one-token step would, which exact verification needs. (Quantizing
activations with one scale per tensor, as `torch.ao`'s dynamic quantization does, would not:
the other tokens would move every token's scale.)
"""
from __future__ import annotations

import torch

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8")
_TINY = 1e-12  # the smallest scale: an all-zero row quantizes to zeros instead of NaN


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (per output channel) and int8 activations (per row)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(_TINY) / 127
        quantized = torch.round(weight / scale).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Two layouts of the same integers: the fastest int8 kernel for one row reads the
        # weight row-major, the one for several rows column-major. Both sum exactly.
        self.register_buffer("rows_layout", quantized, persistent=False)
        self.register_buffer("cols_layout", quantized.t().contiguous(), persistent=False)
        self.register_buffer("scale", scale.view(-1), persistent=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(_TINY) / 127
        quantized = torch.round(rows / row_scale).to(torch.int8)
        weight = self.rows_layout.t() if rows.shape[0] == 1 else self.cols_layout
        out = torch._int_mm(quantized, weight).float() * (row_scale * self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(module: torch.nn.Module) -> int:
    """Replaces every torch.nn.Linear under `module` by an Int8Linear, in place; returns how many."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Int8Linear(child))
            count += 1
        else:
            count += quantize_linears(child)
    return count


def torch_dtype(weights: str) -> torch.dtype:
    """The dtype the model's own (non-int8) tensors are kept in."""
    return torch.float32 if weights == "int8" else getattr(torch, weights)


def fused_linear(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer computing several linears of the same input side by side (q|k|v, gate|up):
    one activation quantization and one matrix multiply instead of several."""
    if all(isinstance(p, Int8Linear) for p in parts):
        fused = Int8Linear.__new__(Int8Linear)
        torch.nn.Module.__init__(fused)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        fused.register_buffer("rows_layout", torch.cat([p.rows_layout for p in parts]), persistent=False)
        fused.register_buffer("cols_layout", torch.cat([p.cols_layout for p in parts], dim=1), persistent=False)
        fused.register_buffer("scale", torch.cat([p.scale for p in parts]), persistent=False)
        biases = [p.bias for p in parts]
    else:
        fused = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None)
        fused = fused.to(parts[0].weight.dtype)
        fused.weight.data = torch.cat([p.weight.detach() for p in parts])
        biases = [p.bias for p in parts]
    if biases[0] is not None:
        fused.bias = torch.nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    elif isinstance(fused, Int8Linear):
        fused.bias = None
    return fused


class KVCache:
    """Keys and values of the tokens a session has fed, preallocated and grown by doubling,
    so a forward writes its new tokens in place instead of concatenating the whole cache."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.keys = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, length: int) -> None:
        capacity = self.keys.shape[2]
        if length > capacity:
            while capacity < length:
                capacity *= 2
            grown = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
            for name in ("keys", "values"):
                bigger = torch.empty_like(grown)
                bigger[:, :, : self.length] = getattr(self, name)[:, :, : self.length]
                setattr(self, name, bigger)

    def keep_positions(self, prefix_len: int, extra: list[int]) -> None:
        """Keep positions [0, prefix_len) plus `extra` (ascending, all >= prefix_len)."""
        if extra:
            index = torch.tensor(extra, device=self.keys.device)
            end = prefix_len + len(extra)
            self.keys[:, :, prefix_len:end] = self.keys[:, :, index]
            self.values[:, :, prefix_len:end] = self.values[:, :, index]
        self.length = prefix_len + len(extra)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class LlamaEngine(torch.nn.Module):
    """A Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral without a sliding window) run by
    one short forward of its own: fused q|k|v and gate|up layers, rotary tables from the
    model's own rotary embedding, an in-place KV cache, logits only where asked. It reads the
    weights of a transformers model (its linears may be Int8Linear) and gives the same
    results as that model up to float rounding."""

    SUPPORTED = ("llama", "qwen2", "mistral")

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        config = model.config
        if not self.supports(model):
            raise ValueError(f"LlamaEngine does not run model type '{config.model_type}'")
        inner = model.model
        self.config = config
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

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        config = model.config
        return (
            config.model_type in LlamaEngine.SUPPORTED
            and getattr(config, "hidden_act", "silu") == "silu"
            and not getattr(config, "sliding_window", None)
            and not getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        )

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def forward(
        self,
        cache: KVCache,
        input_ids: list[int],
        num_logits: int = 1,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        hidden_states: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Feeds `input_ids` after the cached tokens: (logits of the last `num_logits` positions,
        float32; the residual stream after each layer as transformers' output_hidden_states
        gives it, or None). Without a mask every token sees the cache and the tokens before it."""
        start, count = cache.length, len(input_ids)
        cache.reserve(start + count)
        if position_ids is None:
            position_ids = torch.arange(start, start + count, device=self.device)[None]
        x = self.embed(torch.tensor([input_ids], device=self.device))
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        mask = attention_mask
        if mask is None and count > 1:
            mask = torch.ones(count, start + count, dtype=torch.bool, device=self.device).tril(start)[None, None]
        keep = [x] if hidden_states else None
        for index, block in enumerate(self.layers):
            qkv = block.qkv(block.input_norm(x))
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rotate(q.view(1, count, self.num_heads, self.head_dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(1, count, self.num_kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            cache.keys[index, :, start : start + count] = k[0]
            cache.values[index, :, start : start + count] = v.view(count, self.num_kv_heads, self.head_dim).transpose(0, 1)
            attended = _attention(q, cache.keys[index, :, : start + count], cache.values[index, :, : start + count], mask).to(x.dtype)
            x = x + block.o(attended.transpose(1, 2).reshape(1, count, self.q_size))
            gate, up = block.gate_up(block.post_norm(x)).split(self.intermediate, dim=-1)
            x = x + block.down(torch.nn.functional.silu(gate) * up)
            if keep is not None:
                keep.append(x)
        cache.length = start + count
        normed = self.norm(x)
        if keep is not None:
            keep[-1] = normed
        logits = self.lm_head(normed[:, -num_logits:])
        return logits[0].float(), None if keep is None else tuple(keep)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q (1, heads, T, d) over keys/values (kv_heads, S, d), computed in float64 so
    that a token's result does not depend on how many queries share the pass: float32 kernels
    sum in an order that does, and int8 activations downstream would turn that last-bit noise
    into different tokens. Query heads that share a key/value head are stacked (no copies)."""
    kv_heads, length, dim = keys.shape
    count = q.shape[2]
    groups = q.shape[1] // kv_heads
    queries = q[0].double().reshape(kv_heads, groups * count, dim)
    scores = torch.bmm(queries, keys.double().transpose(1, 2)) * dim**-0.5
    if mask is not None:
        scores.masked_fill_(~mask[0, 0].repeat(groups, 1), float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), values.double())
    return out.view(kv_heads * groups, count, dim)[None]
