"""The int8 weight format: the linear layer that makes verifying a draft tree cost little more
than one token on a CPU, and the decoder layer the native kernel runs whole.

`int8` replaces every linear layer of the decoder and the LM
head by `Int8Linear`: weights int8 with one scale per output channel, activations int8 with
one scale per token, products summed in int32. Integer sums are exact, so a token's output
depends on that token alone and not on the other tokens in the same pass: a tree pass gives
each node the logits a one-token step would, which exact verification needs. (Quantizing
activations with one scale per tensor, as `torch.ao`'s dynamic quantization does, would not:
the other tokens would move every token's scale.)
"""
from __future__ import annotations

import torch

from specdec.core.kernels import native
from specdec.core.blocks import BlockLinear
from specdec.core.kquants import KQuantLinear

_CAUSAL = torch.empty(0, dtype=torch.bool)  # the native layer's "no mask"
_TINY = 1e-12  # the smallest scale: an all-zero row quantizes to zeros instead of NaN
_EXACT_SLICE = 1024  # 1024 products of at most 127 * 127 sum below 2**24: exact in float32


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (per output channel) and int8 activations (per row).

    On a CPU the engine's native kernel (specdec/core/kernels) quantizes the rows and streams
    the packed weights once for many rows at a time. Without it, a CPU multiplies the integers
    as float32 in slices of K short enough that every partial sum is an exact integer (below
    2**24 whatever the order), and other devices run ATen's int8 matrix multiply. (oneDNN's
    int8 kernels are not exact on CPUs without VNNI: their 16-bit pair sums saturate.) All of
    them sum the same integers exactly and convert the sum to float32 the same way, so the
    kernel never changes a result."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, smoothing: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("smoothing", smoothing, persistent=False)
        self.kernels = native()
        # The weights are kept once: packed for the kernel (then `weight` unpacks them), else as they are.
        if self.kernels is not None and weight.device.type == "cpu":
            self.register_buffer("packed", self.kernels.pack_weight(weight), persistent=False)
            self.register_buffer("sums", self.kernels.weight_sums(weight), persistent=False)
        else:
            self.register_buffer("stored", weight, persistent=False)
            if weight.device.type == "cpu":
                slices = weight.float().t().split(_EXACT_SLICE)
                self._slices = [(start, part.contiguous()) for start, part in zip(range(0, self.in_features, _EXACT_SLICE), slices)]

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weights [out_features, in_features]."""
        if hasattr(self, "stored"):
            return self.stored
        blocks, steps, channels, inputs = self.packed.shape  # [N/16, K/4, 16, 4]
        rows = self.packed.permute(0, 2, 1, 3).reshape(blocks * channels, steps * inputs)
        return rows[: self.out_features, : self.in_features]

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, input_range: torch.Tensor | None = None) -> "Int8Linear":
        """`input_range`, the largest |input| seen per input channel on calibration text, moves
        activation outliers into the weights (SmoothQuant, alpha 0.5): x/s times W*s, with
        s = sqrt(range). One int8 scale per token then fits the other channels far better."""
        weight = linear.weight.detach().float()
        smoothing = None
        if input_range is not None:
            balance = input_range.float().clamp_min(1e-5).sqrt()
            weight, smoothing = weight * balance, 1 / balance
        low, high = torch.aminmax(weight, dim=1, keepdim=True)  # max |w| without a copy of |w|
        scale = torch.maximum(-low, high).clamp_min(_TINY) / 127
        # in place where `weight` is this function's own copy (smoothed), not the layer's
        quantized = (weight.div_(scale) if input_range is not None else weight / scale).round_().to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(quantized, scale.view(-1), bias, smoothing)

    @classmethod
    def side_by_side(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        """One layer computing several of the same input (q|k|v, gate|up): one activation
        quantization and one multiply instead of several."""
        smoothing = parts[0].smoothing
        if not all(p.smoothing is None if smoothing is None else torch.equal(p.smoothing, smoothing) for p in parts):
            raise ValueError("layers computed side by side must smooth their shared input alike")
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), bias, smoothing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if hasattr(self, "packed") and rows.device.type == "cpu":
            out = self.kernels.int8_linear(rows, self.smoothing, self.packed, self.sums, self.scale, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.smoothing is not None:
            rows = rows * self.smoothing
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(_TINY) / 127
        quantized = torch.round(rows / row_scale)
        if rows.device.type == "cpu":
            sums = sum((quantized[:, start : start + len(part)] @ part).to(torch.int32) for start, part in self._slices)
        else:
            sums = torch._int_mm(quantized.to(torch.int8), self.weight.t())
        out = sums.float() * (row_scale * self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(
    module: torch.nn.Module, input_ranges: dict[str, torch.Tensor] | None = None, block_format: str | None = None, prefix: str = ""
) -> None:
    """Replaces every torch.nn.Linear under `module` by an Int8Linear, in place, smoothed by
    `input_ranges` (qualified module name -> per-channel input range) where given; with a
    `block_format` (q4_0, q4_1, q8_0), those of the decoder layers by a BlockLinear instead (the LM
    head stays int8: GGUF files keep it at 8 bits too)."""
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, torch.nn.Linear):
            if block_format and ".layers." in f".{qualified}":
                setattr(module, name, BlockLinear.from_linear(child, block_format))
            else:
                setattr(module, name, Int8Linear.from_linear(child, (input_ranges or {}).get(qualified)))
        else:
            quantize_linears(child, input_ranges, block_format, f"{qualified}.")


# The linears the native decoder layer multiplies, by the kinds one layer may mix (a GGUF file's
# layers: Q5_0 blocks beside a Q6_K down).
_NATIVE_MIXES = ((Int8Linear,), (BlockLinear, KQuantLinear))
_NATIVE_KINDS = tuple(kind for mix in _NATIVE_MIXES for kind in mix)


def fused_linear(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer computing several linears of the same input side by side (q|k|v, gate|up)."""
    for kind in _NATIVE_KINDS:
        if all(isinstance(p, kind) for p in parts):
            return kind.side_by_side(parts)
    if any(isinstance(p, _NATIVE_KINDS) for p in parts):  # no float matrix to concatenate
        kinds = ", ".join(sorted({type(p).__name__ for p in parts}))
        raise ValueError(f"linears of one input in different kinds ({kinds}) cannot be fused: a GGUF file whose q, k and v "
                         "(or gate and up) mix K-quants and block types is not served as dtype gguf (int8 reads it)")
    bias = parts[0].bias is not None
    fused = torch.nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=bias, dtype=parts[0].weight.dtype)
    fused.weight.data = torch.cat([p.weight.detach() for p in parts])
    if bias:
        fused.bias.data = torch.cat([p.bias.detach() for p in parts])
    return fused.requires_grad_(False)


class NativeLayer:
    """A Llama decoder layer with int8, block or K-quant weights run whole by one call of the native kernel:
    norms, fused q|k|v, rotary, batch-invariant attention over a transposed-key cache, o,
    fused gate|up, down, both residuals. Writes the new keys and values into the cache."""

    def __init__(self, input_norm, qkv, o, post_norm, gate_up, down, eps: float):
        empty = torch.empty(0)
        norms = [n.weight.detach().float().contiguous() for n in (input_norm, post_norm)]
        parts = [_native_tensors(m, empty) for m in (qkv, o, gate_up, down)]
        self.weights = native().LayerWeights(
            [norms[0], *parts[0], *parts[1], norms[1], *parts[2], *parts[3]], [m.out_features for m in (qkv, o, gate_up, down)], eps
        )

    def __call__(self, x, cos, sin, keys: list, values: list, starts: list[int], counts: list[int], masks: list, heads: int,
                 up_delta: torch.Tensor | None = None):
        """x (T, H) float32: the rows of one or more sequences, sequence i counts[i] rows after
        starts[i] positions of its cache (keys[i], values[i]: this layer's), attending under
        masks[i] ((counts[i], starts[i] + counts[i]) bool, or None: causal); cos/sin
        (T, head_dim). Returns the layer's output (T, H): each row exactly what its sequence
        alone would give."""
        masks = [_CAUSAL if m is None else m for m in masks]
        return native().native_decoder_layer(x, self.weights, cos, sin, keys, values, starts, counts, masks, heads, up_delta)


def _native_tensors(linear, empty: torch.Tensor) -> list[torch.Tensor]:
    """A linear's five tensors as the native layer reads them (Int8Layer, BlockLayer, KQuantLayer)."""
    bias = empty if linear.bias is None else linear.bias
    if isinstance(linear, KQuantLinear):
        return [linear.packed, linear.table, bias, empty, empty]
    if isinstance(linear, BlockLinear):
        return [linear.packed, bias, empty, empty, empty]
    return [linear.packed, linear.sums, linear.scale, bias, empty if linear.smoothing is None else linear.smoothing]


def native_layer(input_norm, qkv, o, post_norm, gate_up, down, eps: float) -> NativeLayer | None:
    """The layer for the native kernel, or None where it does not apply (weights not all int8 or
    all blocks and K-quants; no kernels; not on the CPU)."""
    linears = (qkv, o, gate_up, down)
    if native() is None or not any(all(isinstance(m, kinds) for m in linears) for kinds in _NATIVE_MIXES):
        return None
    if not all(getattr(m, "packed", None) is not None and m.packed.device.type == "cpu" for m in linears):
        return None
    return NativeLayer(input_norm, qkv, o, post_norm, gate_up, down, eps)
