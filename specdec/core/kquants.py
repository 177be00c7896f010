"""The weight format `gguf`: a GGUF file's tensors served as the file stores them, each in its own
format: K-quants (Q4_K, Q6_K) here, and the block types Q4_0, Q4_1, Q5_0 and Q8_0 through
specdec/core/blocks.py (`file_blocks`).

Along each row, super-blocks of 256 weights carry float16 factors d and dmin and, per 16
weights, small integer factors a and b, so that every weight is

    w = d a q - dmin b      Q4_K: q in [0, 15], a and b the 6-bit scale and min of its 32;
                            Q6_K: q in [0, 63], a its signed 8-bit scale, b = a, dmin = 32 d.

Each tensor keeps its own format (a Q4_K_M file mixes both, even within one fused q|k|v), so a
step reads ~4.6 or ~6.6 bits a weight instead of int8's 8. Activations are int8 in super-blocks
of 256 with one scale each (GGUF's Q8_K), and a super-block adds
float(sum a sum q xq) (d s) - float(sum b sum xq) (dmin s) to a row: integer sums exact, the float
sums over a row's super-blocks in order, so a token's output depends on that token alone and a
tree pass gives every node the logits of a one-token step.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.core.blocks import FILE_BLOCK_TYPES, BlockLinear, dequantize_blocks, file_blocks
from specdec.core.gguf_file import gguf_tensors
from specdec.core.kernels import native

KQUANT_TYPES = ("Q4_K", "Q6_K")
GGUF_TYPES = (*KQUANT_TYPES, *FILE_BLOCK_TYPES)  # what dtype gguf serves as stored
SUPER = 256  # weights per super-block along a row
KQUANT_ROWS = 16  # output channels per packed group: one vector of the native kernel
_FORMAT_CODES = {"Q4_K": 0, "Q6_K": 1}  # kernels/kquants.h's KFormat
_RAW_BYTES = {"Q4_K": 144, "Q6_K": 210}  # a super-block in the file
_TINY = 1e-12  # the smallest activation scale: an all-zero super-block quantizes to zeros


@dataclass
class KBlocks:
    """One tensor's K-quant blocks, unpacked: q uint8 [N, K]; a and b int8 [N, K/16] (the factors
    of each 16 weights); d and dmin float16 [N, K/256]."""

    kind: str
    q: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K], computed with gguf-py's operations (so bit for bit its
        dequantization of the same file)."""
        n = self.q.shape[0]
        scale = (self.d.float().repeat_interleave(SUPER // 16, 1) * self.a.float())[..., None]
        q = self.q.view(n, -1, 16).float()
        if self.kind == "Q6_K":
            return (scale * (q - 32)).view(n, -1)
        low = (self.dmin.float().repeat_interleave(SUPER // 16, 1) * self.b.float())[..., None]
        return (scale * q - low).view(n, -1)


def decode(raw: np.ndarray, kind: str) -> KBlocks:
    """A GGUF tensor's rows as the file stores them (uint8 [N, K/256 * bytes]) -> its blocks."""
    if kind not in KQUANT_TYPES:
        raise ValueError(f"K-quant formats are {', '.join(KQUANT_TYPES)}, not {kind}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, _RAW_BYTES[kind])
    if kind == "Q4_K":
        d, dmin = blocks[..., 0:2].copy().view(np.float16)[..., 0], blocks[..., 2:4].copy().view(np.float16)[..., 0]
        s = blocks[..., 4:16].astype(np.uint8)
        # 8 six-bit scales and mins in 12 bytes: the first four in the low 6 bits of bytes 0-3
        # (scales) and 4-7 (mins), the last four split between bytes 8-11 and the top 2 bits.
        scales = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mins = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = blocks[..., 16:144].reshape(n, -1, 4, 1, 32)  # 4 chunks of 64 weights: low nibbles, then high
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1)
        a, b = (np.repeat(t, 2, axis=-1).reshape(n, -1) for t in (scales, mins))
    else:
        ql = blocks[..., 0:128].reshape(n, -1, 2, 1, 64)  # two halves of 128: low nibbles, then high
        low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(n, -1, 2, 128)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)  # each half's top 2 bits, 32 weights a shift
        high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(n, -1, 2, 128)
        q = (low | (high << 4)).reshape(n, -1)
        a = blocks[..., 192:208].copy().view(np.int8).reshape(n, -1)
        b = a
        d = blocks[..., 208:210].copy().view(np.float16)[..., 0]
        dmin = (d.astype(np.float32) * 32).astype(np.float16)  # a power of two: exact
        if not np.isfinite(dmin).all():
            raise ValueError("a Q6_K super-block's d is too large to serve (32 d overflows float16)")
    tensors = (torch.from_numpy(np.ascontiguousarray(t)) for t in (q, a.astype(np.int8), b.astype(np.int8), d, dmin))
    return KBlocks(kind, *tensors)


def _factor_bytes(blocks: KBlocks, groups: int, supers: int) -> torch.Tensor:
    """[groups, supers, 256]: per sub-block of 32, Q4_K's a then b for the 16 channels; Q6_K's
    (a of inputs 0-15, a of 16-31) per channel."""
    if blocks.kind == "Q4_K":
        per_32 = [t[:, ::2].reshape(groups, KQUANT_ROWS, supers, 8) for t in (blocks.a, blocks.b)]
        return torch.stack(per_32, dim=3).permute(0, 2, 4, 3, 1).reshape(groups, supers, 256)
    return blocks.a.view(groups, KQUANT_ROWS, supers, 8, 2).permute(0, 2, 3, 1, 4).reshape(groups, supers, 256)


def pack(blocks: KBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 stream, groups int64 [N/16, 3]) in the native kernel's layout
    (kernels/kquants.h): per group of 16 channels, its super-blocks one after another."""
    n, k = blocks.q.shape
    if n % KQUANT_ROWS or k % SUPER:
        raise ValueError(f"K-quant tensors need rows in multiples of {KQUANT_ROWS} and columns of {SUPER}, not {n} x {k}")
    groups, supers = n // KQUANT_ROWS, k // SUPER
    # [group, channel, super, sub-block, half, step, 4] -> bytes [group, super, sub-block, step, channel, 4]
    q = blocks.q.view(groups, KQUANT_ROWS, supers, 8, 2, 4, 4)
    nibbles = ((q[:, :, :, :, 0] & 15) | ((q[:, :, :, :, 1] & 15) << 4)).permute(0, 2, 3, 4, 1, 5).reshape(groups, supers, 2048)
    parts = [nibbles]
    if blocks.kind == "Q6_K":
        high = (q >> 4).view(groups, KQUANT_ROWS, supers, 8, 8, 4)  # step s = half * 4 + i
        pairs = high[:, :, :, :, 0:2] | (high[:, :, :, :, 2:4] << 2) | (high[:, :, :, :, 4:6] << 4) | (high[:, :, :, :, 6:8] << 6)
        parts.append(pairs.permute(0, 2, 3, 4, 1, 5).reshape(groups, supers, 1024))
    parts.append(_factor_bytes(blocks, groups, supers).view(torch.uint8))
    for t in (blocks.d, blocks.dmin):
        parts.append(t.view(groups, KQUANT_ROWS, supers).transpose(1, 2).contiguous().view(torch.uint8).view(groups, supers, 32))
    stream = torch.cat(parts, dim=-1).reshape(groups, -1)
    table = torch.tensor([[g * stream.shape[1], _FORMAT_CODES[blocks.kind], supers] for g in range(groups)], dtype=torch.int64)
    return stream.reshape(-1).contiguous(), table


def _group_bytes(kind: str, supers: int) -> int:
    return supers * (2048 + (1024 if kind == "Q6_K" else 0) + 256 + 64)


def unpack(packed: torch.Tensor, table: torch.Tensor) -> list[KBlocks]:
    """pack's inverse for each run of groups of one format (a fused layer's parts)."""
    runs: list[tuple[str, int, int]] = []  # (kind, first group, groups)
    kinds = {code: kind for kind, code in _FORMAT_CODES.items()}
    for g, (_, code, _) in enumerate(table.tolist()):
        if runs and runs[-1][0] == kinds[code]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((kinds[code], g, 1))
    supers = int(table[0, 2])
    out = []
    for kind, first, count in runs:
        start = int(table[first, 0])
        data = packed[start : start + count * _group_bytes(kind, supers)].view(count, supers, -1)
        nibbles = data[..., :2048].view(count, supers, 8, 4, KQUANT_ROWS, 4).permute(0, 4, 1, 2, 3, 5)
        q = torch.stack([nibbles & 15, nibbles >> 4], dim=4)  # [group, channel, super, sub-block, half, step, 4]
        at = 2048
        if kind == "Q6_K":
            pairs = data[..., at : at + 1024].view(count, supers, 8, 2, KQUANT_ROWS, 4).permute(0, 4, 1, 2, 3, 5)
            high = torch.cat([(pairs >> shift) & 3 for shift in (0, 2, 4, 6)], dim=4).view(q.shape)
            q = q | (high << 4)
            at += 1024
        factors = data[..., at : at + 256].contiguous().view(torch.int8)
        if kind == "Q4_K":
            ab = factors.view(count, supers, 8, 2, KQUANT_ROWS).permute(3, 0, 4, 1, 2).repeat_interleave(2, -1)
            a, b = (t.reshape(count * KQUANT_ROWS, -1) for t in ab)
        else:
            a = factors.view(count, supers, 8, KQUANT_ROWS, 2).permute(0, 3, 1, 2, 4).reshape(count * KQUANT_ROWS, -1)
            b = a
        halves = (data[..., at + 256 + i * 32 : at + 288 + i * 32].contiguous().view(torch.float16) for i in (0, 1))
        d, dmin = (t.transpose(1, 2).reshape(count * KQUANT_ROWS, -1).contiguous() for t in halves)
        q = q.reshape(count * KQUANT_ROWS, -1).contiguous()
        out.append(KBlocks(kind, q, a.contiguous(), b.contiguous(), d, dmin))
    return out


class KQuantLinear(torch.nn.Module):
    """A linear layer with K-quant weights and int8 super-block activations (module docstring).
    On a CPU with the native kernels they multiply there; elsewhere the same integer sums and
    factors run as torch ops. Each path on its own gives a row the same result whatever else
    its pass holds."""

    def __init__(self, packed: torch.Tensor, table: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.kernels = native()
        self._unpacked: list[KBlocks] | None = None  # the torch path's weights, made on first use

    @classmethod
    def from_blocks(cls, blocks: KBlocks, bias: torch.Tensor | None = None) -> "KQuantLinear":
        packed, table = pack(blocks)
        return cls(packed, table, bias, blocks.q.shape[1], blocks.q.shape[0])

    @classmethod
    def side_by_side(cls, parts: list["KQuantLinear"]) -> "KQuantLinear":
        """One layer computing several of the same input (q|k|v, gate|up), each part keeping its format."""
        tables, offset = [], 0
        for part in parts:
            table = part.table.clone()
            table[:, 0] += offset
            tables.append(table)
            offset += part.packed.numel()
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([torch.zeros(p.out_features) if p.bias is None else p.bias for p in parts])
        return cls(torch.cat([p.packed for p in parts]), torch.cat(tables), bias, parts[0].in_features, sum(p.out_features for p in parts))

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weights [out, in] the blocks stand for."""
        return torch.cat([part.dequantize() for part in unpack(self.packed, self.table)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.kernels is not None and rows.device.type == "cpu":
            out = self.kernels.kquant_linear(rows, self.packed, self.table, self.bias, self.out_features)
        else:
            out = self._torch_forward(rows)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _torch_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The native kernel's arithmetic in torch ops: the same integer sums, each row's
        super-blocks added in order (without fused multiply-adds)."""
        if self._unpacked is None:
            self._unpacked = unpack(self.packed, self.table)
        supers = self.in_features // SUPER
        blocks = rows.view(rows.shape[0], supers, SUPER)
        scale = blocks.abs().amax(-1).clamp_min(_TINY) / 127
        xq = torch.round(blocks / scale[..., None]).view(rows.shape[0], -1, 16)
        outs = []
        for part in self._unpacked:
            sums = torch.einsum("rgi,ngi->rng", xq.double(), part.q.view(part.q.shape[0], -1, 16).double())  # exact integers
            ia = (sums * part.a.double()).view(rows.shape[0], -1, supers, SUPER // 16).sum(-1)
            ib = (xq.double().sum(-1)[:, None] * part.b.double()).view(rows.shape[0], -1, supers, SUPER // 16).sum(-1)
            total = torch.zeros(rows.shape[0], part.q.shape[0])
            for sb in range(supers):
                s = scale[:, sb, None]
                total = total + ia[..., sb].float() * (part.d[:, sb].float() * s)
                total = total - ib[..., sb].float() * (part.dmin[:, sb].float() * s)
            outs.append(total)
        out = torch.cat(outs, dim=1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        codes = set(self.table[:, 1].tolist())
        kinds = [kind for kind, code in _FORMAT_CODES.items() if code in codes]
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={'+'.join(kinds)}, bias={self.bias is not None}"


# GGUF tensor names of a Llama-family decoder -> the transformers module they fill.
_GGUF_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """The file row each weight row of a llama q or k projection comes from: llama.cpp's
    converter interleaves each head's two rotary halves, transformers' loader undoes it."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(1, 2).reshape(n)


def load_gguf_linears(model: torch.nn.Module, gguf_path: Path) -> None:
    """Replaces the decoder's linears and the LM head of `model` (loaded from the same file's
    dequantized copy) by layers holding the file's own blocks: KQuantLinear for K-quants,
    BlockLinear for block types. Refuses a file whose linears are stored in another format, and
    checks each tensor's first rows against the model's weights (the same file, dequantized by
    transformers)."""
    config = model.config
    tensors = gguf_tensors(gguf_path)
    targets = {f"blk.{i}.{g}.weight": f"model.layers.{i}.{m}" for i in range(config.num_hidden_layers) for g, m in _GGUF_LINEARS.items()}
    # A head cut to a draft vocabulary (ScatteredHead) takes those rows of the file's.
    head_rows = getattr(model, "draft_vocab_ids", None)
    targets["output.weight" if "output.weight" in tensors else "token_embd.weight"] = "lm_head" if head_rows is None else "lm_head.head"
    others = sorted({tensors[name].kind for name in targets if tensors[name].kind not in GGUF_TYPES})
    if others:
        raise ValueError(f"{gguf_path.name} stores linears as {', '.join(others)}; dtype gguf serves {', '.join(GGUF_TYPES)} "
                         f"(int8 reads any file)")
    modules = dict(model.named_modules())

    def serve(name: str, target: str) -> torch.nn.Module:
        tensor = tensors[name]
        raw = tensor.data
        if config.model_type == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if name.split(".")[-2] == "attn_q" else config.num_key_value_heads
            raw = raw[_llama_rows(raw.shape[0], heads)]
        if target == "lm_head.head":
            raw = raw[head_rows.numpy()]
        module = modules[target]
        sample = slice(0, min(KQUANT_ROWS, raw.shape[0]))
        expected = module.weight.detach()[sample].float()
        bias = None if getattr(module, "bias", None) is None else module.bias.detach().float()
        if tensor.kind in KQUANT_TYPES:
            blocks = decode(raw, tensor.kind)
            check = KBlocks(blocks.kind, *(t[sample] for t in (blocks.q, blocks.a, blocks.b, blocks.d, blocks.dmin))).dequantize()
            served = KQuantLinear.from_blocks(blocks, bias)
        else:
            check = dequantize_blocks(*file_blocks(raw[sample], tensor.kind)[:3])
            served = BlockLinear.from_file_blocks(raw, tensor.kind, bias)
        if not torch.equal(check, expected):
            raise ValueError(f"{name} in {gguf_path.name} does not dequantize to the model's {target}.weight")
        return served

    # numpy and torch release the GIL in the large array operations of a tensor's conversion:
    # one tensor a thread keeps both cores busy.
    with ThreadPoolExecutor(max(torch.get_num_threads(), 1)) as pool:
        layers = pool.map(serve, targets.keys(), targets.values())
        for target, layer in zip(targets.values(), layers):
            parent, _, child = target.rpartition(".")
            setattr(modules[parent] if parent else model, child, layer)
