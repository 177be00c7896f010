"""An independent reference of the engine's int8 format: a plain, slow, whole-sequence Llama
forward written from the format's definition, sharing no code with the engine (not its
layers, fused linears, caches, attention or kernels). It reads only the quantized
transformers model the engine is built from.

The format: each linear's weight int8 with one scale per output channel (inputs smoothed
per channel where calibrated); each activation row int8 with its own scale, products summed
exactly; keys, values, queries and attention weights rounded to bfloat16 where the CPU's
kernels keep them so (`cache_dtype`), else keys and values to float16. Sums here run in
float64, so the reference differs from the kernels only by float32 summation order, which
moves an int8 activation across a rounding boundary rarely."""
from __future__ import annotations

import torch


def int8_linear(x: torch.Tensor, layer) -> torch.Tensor:
    rows = x.float()
    if layer.smoothing is not None:
        rows = rows * layer.smoothing
    row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    integers = torch.round(rows / row_scale).double() @ layer.weight.double().t()  # exact: |sum| < 2**53
    out = integers.float() * (row_scale * layer.scale)
    return out if layer.bias is None else out + layer.bias


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).float() * norm.weight.float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of (T, heads, d) queries over (T, kv_heads, d) keys and values."""
    count, heads, dim = q.shape
    groups = heads // k.shape[1]
    k, v = k.to(cache_dtype).double(), v.to(cache_dtype).double()
    if cache_dtype == torch.bfloat16:
        q = q.to(torch.bfloat16)
    q = q.double()
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k).float() * dim**-0.5
    causal = torch.ones(count, count, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    numerators = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    total = numerators.double().sum(-1, keepdim=True)
    if cache_dtype == torch.bfloat16:
        numerators = numerators.to(torch.bfloat16)
    return (torch.einsum("hts,shd->thd", numerators.double(), v) / total.transpose(0, 1)).float()


@torch.inference_mode()
def int8_logits(model, token_ids: list[int], cache_dtype: torch.dtype) -> torch.Tensor:
    """The logits after every position of `token_ids`, from one causal pass."""
    inner, config = model.model, model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    x = inner.embed_tokens(torch.tensor(token_ids)).float()
    cos, sin = inner.rotary_emb(x[None], torch.arange(len(token_ids))[None])
    cos, sin = cos[0, :, None].float(), sin[0, :, None].float()
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = rms_norm(x, layer.input_layernorm)
        q = rotate(int8_linear(h, attn.q_proj).view(-1, heads, dim), cos, sin)
        k = rotate(int8_linear(h, attn.k_proj).view(-1, kv_heads, dim), cos, sin)
        v = int8_linear(h, attn.v_proj).view(-1, kv_heads, dim)
        x = x + int8_linear(attention(q, k, v, cache_dtype).reshape(len(token_ids), -1), attn.o_proj)
        h = rms_norm(x, layer.post_attention_layernorm)
        x = x + int8_linear(torch.nn.functional.silu(int8_linear(h, mlp.gate_proj)) * int8_linear(h, mlp.up_proj), mlp.down_proj)
    return int8_linear(rms_norm(x, inner.norm), model.lm_head)
