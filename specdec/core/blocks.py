"""The block weight formats `q4_0`, `q4_1` and `q8_0`: GGUF's Q4_0, Q4_1 and Q8_0 blocks, kept as blocks.

Along each row of a weight matrix, every 32 weights form a block w = d q + m with one float16
d and m per block: q in [0, 15] for the 4-bit formats (Q4_0 is symmetric: m = -8 d), and for
Q8_0, whose signed q in [-127, 127] is kept as q + 128 in [0, 255], m = -128 d. A step of a
memory-bound decoder reads 0.625 bytes a weight (4 bits) or 1.125 (8 bits) instead of int8's
one. A weight matrix is quantized to blocks the way llama.cpp's reference quantizers do, so the
dequantized weights of a GGUF file in one of these formats give its own blocks back: the model
served is the file's model as written. A GGUF file's own blocks are also read as they are
(`file_blocks`, for the weight format `gguf`): Q4_0, Q4_1 and Q8_0 as above, and Q5_0 (q in
[0, 31], w = d (q - 16), so m = -16 d) in 5-bit blocks: the 4-bit layout's nibbles and a plane of
fifth bits, 0.75 bytes a weight where 8-bit blocks would read 1.125.

Activations are int8 in blocks of 32 with a scale each (as GGUF's Q8 activations), so
  sum x w = sum over blocks of float(sum q xq) (d s) + m (s sum xq),
integer sums exact, each row's blocks summed in order: a token's output depends on that token
alone, and a tree pass gives each node the logits of a one-token step, as with int8.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.core.kernels import native

BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0")
# GGUF's block types file_blocks reads: a block's bytes in the file, the bits a weight takes packed
_FILE_BLOCKS = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q5_0": (22, 5), "Q8_0": (34, 8)}
FILE_BLOCK_TYPES = tuple(_FILE_BLOCKS)
BLOCK = 32  # weights per block along a row
_CHANNELS = 16  # output channels per packed group: one vector of the native kernel
_TINY = 1e-12  # the smallest activation scale: an all-zero block quantizes to zeros


def quantize_blocks(weight: torch.Tensor, block_format: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K'], d float16 [N, K'/32], m float16 [N, K'/32]) for float weights [N, K];
    K' is K padded to whole blocks with zero weights."""
    if block_format not in BLOCK_FORMATS:
        raise ValueError(f"block formats are {', '.join(BLOCK_FORMATS)}, not {block_format}")
    n, k = weight.shape
    blocks = torch.nn.functional.pad(weight.float(), (0, -k % BLOCK)).view(n, -1, BLOCK)
    if block_format == "q8_0":  # d = max |w| / 127, q = round(w / d), half away from zero
        d = blocks.abs().amax(-1) / 127
        inverse = _inverse(d)
        scaled = blocks * inverse[..., None]
        whole = scaled.trunc()  # C's roundf, exactly: the fraction decides (x + 0.5 would round first)
        q = (whole + ((scaled - whole).abs() >= 0.5) * scaled.sign()).to(torch.int32) + 128
        d16 = d.half()
        return q.to(torch.uint8).view(n, -1), d16, d16 * -128
    if block_format == "q4_1":  # d = (max - min) / 15, m = min
        low, high = blocks.amin(-1), blocks.amax(-1)
        d = (high - low) / 15
        inverse = _inverse(d)
        q = ((blocks - low[..., None]) * inverse[..., None] + 0.5).to(torch.int32).clamp(max=15)
        return q.to(torch.uint8).view(n, -1), d.half(), low.half()
    # q4_0: d = (the weight of largest magnitude) / -8, q = round(w / d) + 8
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))[..., 0]
    d = largest / -8
    inverse = _inverse(d)
    q = (blocks * inverse[..., None] + 8.5).to(torch.int32).clamp(max=15)
    d16 = d.half()
    return q.to(torch.uint8).view(n, -1), d16, d16 * -8


def file_blocks(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q, d, m, bits) of a GGUF tensor's rows as the file stores them (uint8 [N, K/32 * bytes]),
    each block's weights exactly the file's: d q + m is gguf-py's dequantization bit for bit
    (q times a float16 d, and m a multiple of d by a power of two, are exact in float32)."""
    if kind not in FILE_BLOCK_TYPES:
        raise ValueError(f"GGUF block types read as they are: {', '.join(FILE_BLOCK_TYPES)}, not {kind}")
    n = raw.shape[0]
    block_size, bits = _FILE_BLOCKS[kind]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, block_size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q, m = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128, -128 * d
    else:
        nibbles = blocks[..., -16:]  # weight j in the low nibble of byte j, weight 16 + j in the high one
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int16)
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        elif kind == "Q4_0":
            m = -8 * d
        else:  # Q5_0: bit j of a little-endian 32-bit word is weight j's fifth
            fifth = (blocks[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
            q, m = q | (fifth << 4), -16 * d
    if not np.isfinite(m.astype(np.float16)).all():
        raise ValueError(f"a {kind} block's d is too large to serve (its m overflows float16)")
    arrays = (q.astype(np.uint8).reshape(n, -1), d.astype(np.float16), m.astype(np.float16))
    q, d, m = (torch.from_numpy(np.ascontiguousarray(t)) for t in arrays)
    return q, d, m, bits


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (a block of equal or zero weights)."""
    return torch.where(d != 0, 1 / d, torch.zeros_like(d))


def dequantize_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K'] the blocks stand for."""
    n = q.shape[0]
    return (q.view(n, -1, BLOCK).float() * d.float()[..., None] + m.float()[..., None]).view(n, -1)


def weight_bytes(bits: int) -> int:
    """The bytes of one packed block's weights: 16 channels x 32 weights."""
    return bits * BLOCK * _CHANNELS // 8


def block_bytes(bits: int) -> int:
    """The bytes of one packed block: its weights, then 16 d and 16 m in float16."""
    return weight_bytes(bits) + 2 * _CHANNELS * 2


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """The native kernel's layout, one stream of blocks [N/16, K/32, bytes]: 16 channels'
    weights in the order VNNI's 4-way dot product reads them, then their 16 d and 16 m in
    float16. 8 bits: byte (i, c, j) is input 4i + j of channel c (512 bytes); 4 bits: the same
    byte holds input 4i + j in its low nibble and 16 + 4i + j in its high one (256 bytes);
    5 bits: those nibbles, then per step i a 64-bit little-endian word whose bit 4c + j is input
    4i + j's fifth (64 bytes: the step's byte mask). Channels padded to 16 with zeros."""
    n_pad = -q.shape[0] % _CHANNELS
    q, d, m = (torch.nn.functional.pad(t, (0, 0, 0, n_pad)) for t in (q, d, m))
    groups, k_blocks = q.shape[0] // _CHANNELS, d.shape[1]
    steps = q.view(groups, _CHANNELS, k_blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [groups, blocks, step, channel, 4]
    if bits == 8:
        weights = steps.reshape(groups, k_blocks, weight_bytes(8))
    else:
        low = steps & 0x0F
        nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)
        weights = nibbles.reshape(groups, k_blocks, weight_bytes(4))
        if bits == 5:
            fifths = (steps >> 4).reshape(groups, k_blocks, 8 * 8, 8) << torch.arange(8, dtype=torch.uint8)
            weights = torch.cat([weights, fifths.sum(-1, dtype=torch.uint8)], dim=-1)
    scales = [t.view(groups, _CHANNELS, k_blocks).transpose(1, 2).contiguous().view(torch.uint8) for t in (d, m)]
    return torch.cat([weights, *scales], dim=-1).contiguous()


def packed_bits(packed: torch.Tensor) -> int:
    """The bits a weight of a packed tensor takes."""
    return {block_bytes(bits): bits for bits in (4, 5, 8)}[packed.shape[-1]]


def unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's inverse, (q, d, m) of the first n channels."""
    groups, k_blocks = packed.shape[:2]
    bits = packed_bits(packed)
    size = weight_bytes(bits)
    if bits == 8:
        steps = packed[..., :size].reshape(groups, k_blocks, 8, _CHANNELS, 4)
    else:
        nibbles = packed[..., : weight_bytes(4)].reshape(groups, k_blocks, 4, _CHANNELS, 4)
        steps = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # [groups, blocks, 8, channel, 4]
        if bits == 5:
            fifths = (packed[..., weight_bytes(4) : size, None] >> torch.arange(8, dtype=torch.uint8)) & 1
            steps = steps | (fifths.reshape(steps.shape) << 4)
    q = steps.permute(0, 3, 1, 2, 4).reshape(groups * _CHANNELS, k_blocks * BLOCK)
    d, m = (packed[..., start : start + 2 * _CHANNELS].contiguous().view(torch.float16) for start in (size, size + 2 * _CHANNELS))
    by_channel = lambda t: t.transpose(1, 2).reshape(groups * _CHANNELS, k_blocks)  # noqa: E731
    return q[:n].contiguous(), by_channel(d)[:n].contiguous(), by_channel(m)[:n].contiguous()


class BlockLinear(torch.nn.Module):
    """A linear layer with block weights and int8 block activations (module docstring).
    On a CPU with the native kernels they multiply there; elsewhere the same sums and scales run
    as torch ops, equal to rounding (the kernel fuses its multiply-adds). Each path on its own
    gives a row the same result whatever else its pass holds."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None, in_features: int, bits: int):
        super().__init__()
        self.out_features, self.in_features = q.shape[0], in_features
        self.register_buffer("packed", pack(q, d, m, bits), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.kernels = native()
        self._unpacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the torch path's weights, made on first use

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block_format: str) -> "BlockLinear":
        q, d, m = quantize_blocks(linear.weight.detach(), block_format)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(q, d, m, bias, linear.in_features, 8 if block_format == "q8_0" else 4)

    @classmethod
    def from_file_blocks(cls, raw: np.ndarray, kind: str, bias: torch.Tensor | None = None) -> "BlockLinear":
        """A GGUF tensor's own blocks (file_blocks) as a layer."""
        q, d, m, bits = file_blocks(raw, kind)
        return cls(q, d, m, bias, q.shape[1], bits)

    @classmethod
    def side_by_side(cls, parts: list["BlockLinear"]) -> "BlockLinear":
        """One layer computing several of the same input (q|k|v, gate|up), in the widest of its
        parts' blocks (a narrower q holds in more bits as it is)."""
        blocks = [unpack(p.packed, p.out_features) for p in parts]
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat(biases)
        bits = max(packed_bits(p.packed) for p in parts)
        return cls(*(torch.cat(column) for column in zip(*blocks)), bias, parts[0].in_features, bits)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weights [out, in] the blocks stand for."""
        return dequantize_blocks(*unpack(self.packed, self.out_features))[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.kernels is not None and rows.device.type == "cpu":
            out = self.kernels.block_linear(rows, self.packed, self.bias, self.out_features)
        else:
            out = self._torch_forward(rows)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _torch_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The native kernel's arithmetic in torch ops: the same integer sums (exact in float32:
        32 products of at most 255 * 127), each row's blocks added in order, without fused
        multiply-adds."""
        if self._unpacked is None:
            q, d, m = unpack(self.packed, self.out_features)
            self._unpacked = q.view(q.shape[0], -1, BLOCK).float(), d.float(), m.float()
        q, d, m = self._unpacked
        blocks = torch.nn.functional.pad(rows, (0, q.shape[1] * BLOCK - self.in_features)).view(rows.shape[0], -1, BLOCK)
        scale = blocks.abs().amax(-1).clamp_min(_TINY) / 127
        xq = torch.round(blocks / scale[..., None])
        scaled_sums = scale * xq.sum(-1)
        sums = torch.einsum("rbi,nbi->rnb", xq, q)
        total = torch.zeros(rows.shape[0], self.out_features)
        for b in range(sums.shape[-1]):
            total = total + sums[..., b] * (d[:, b] * scale[:, b, None])
            total = total + m[:, b] * scaled_sums[:, b, None]
        return total if self.bias is None else total + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
