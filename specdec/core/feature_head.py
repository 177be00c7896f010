"""A drafter that reads the verifier's own features (EAGLE-3 style, across the network).

The verifier fuses its residual stream at three depths into one feature per position
(`FeatureFuse`: each depth RMS-normalised, then Linear(3H -> H)) and sends the features of
the positions it commits. The drafter is one decoder layer over its own KV cache. The entry
at position j reads the token t_j and the verifier's feature of position j-1, each
RMS-normalised and fused by FC(2H -> H) (normalising first, as EAGLE-3 does, keeps the
token from drowning in the residual stream's outlier channels); its output
predicts t_{j+1} over the reduced draft vocabulary. A draft continues on the head's own
outputs: a drafted node reads its token and its parent's output instead of a verifier
feature, as the head was trained to (the training-time test, specdec/train/distill_head.py).
Position 0 has no feature before it and reads zeros.

A checkpoint is a directory next to nothing else:
  feature_head.json          base model, verifier layers fused, training recipe
  feature_head.safetensors   fuse (the verifier's half), fc, layer, norm (the drafter's half)
  draft_vocab.json           the token ids the head predicts
The embeddings and the head's rows are the base model's and are not stored twice.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specdec.core.hub import load_model_weights_only, resolve_alias

META, WEIGHTS, VOCAB = "feature_head.json", "feature_head.safetensors", "draft_vocab.json"


class FeatureHeadError(ValueError):
    pass


class _RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class FeatureFuse(torch.nn.Module):
    """The verifier's half: Linear(3H -> H) over its residual stream at three depths (indices
    into output_hidden_states), each RMS-normalised, initialised as their sum."""

    def __init__(self, hidden_size: int, layers: list[int], eps: float = 1e-6):
        super().__init__()
        if len(layers) != 3:
            raise FeatureHeadError(f"a feature fuses exactly 3 verifier depths, got {layers}")
        self.layers, self.eps = list(layers), eps
        self.proj = torch.nn.Linear(3 * hidden_size, hidden_size, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(hidden_size).repeat(1, 3))

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.fuse_depths(torch.stack([hidden_states[i] for i in self.layers], dim=-2))

    def fuse_depths(self, depths: torch.Tensor) -> torch.Tensor:
        """(..., 3, H) -> (..., H)."""
        depths = depths.float()
        normed = depths * torch.rsqrt(depths.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.proj(normed.flatten(-2).to(self.proj.weight.dtype))


class HeadLayer(torch.nn.Module):
    """One Llama decoder layer whose attention takes its past keys and values explicitly, so
    training can attend across unrolled steps and serving across a session's cache."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.input_norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.post_norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.q = torch.nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k = torch.nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.gate = torch.nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up = torch.nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down = torch.nn.Linear(config.intermediate_size, hidden, bias=False)

    def load_from(self, layer: torch.nn.Module) -> None:
        """Copies a transformers Llama decoder layer's weights."""
        attn, mlp = layer.self_attn, layer.mlp
        pairs = [
            (self.input_norm, layer.input_layernorm), (self.post_norm, layer.post_attention_layernorm),
            (self.q, attn.q_proj), (self.k, attn.k_proj), (self.v, attn.v_proj), (self.o, attn.o_proj),
            (self.gate, mlp.gate_proj), (self.up, mlp.up_proj), (self.down, mlp.down_proj),
        ]
        with torch.no_grad():
            for mine, theirs in pairs:
                mine.weight.copy_(theirs.weight)

    def forward(self, x, cos, sin, past_keys, past_values, mask):
        """x (B, T, H); past keys/values (B, kv_heads, S, d) or None; mask (B|1, 1, T, S+T),
        True = attend. Returns (output, this pass's keys, values)."""
        batch, count, _ = x.shape
        normed = self.input_norm(x)
        q = self.q(normed).view(batch, count, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k(normed).view(batch, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(normed).view(batch, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys = k if past_keys is None else torch.cat([past_keys, k], dim=2)
        values = v if past_values is None else torch.cat([past_values, v], dim=2)
        attended = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, count, -1))
        mlp_in = self.post_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(mlp_in)) * self.up(mlp_in)), k, v


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FeatureHead(torch.nn.Module):
    """fc(embed(token) | feature) -> one decoder layer -> norm -> head over the draft vocabulary.
    `fuse` is the verifier's half: it turns three residual-stream depths into the feature."""

    def __init__(self, config, layers: list[int], vocab_ids: list[int]):
        super().__init__()
        hidden = config.hidden_size
        self.config = copy.deepcopy(config)
        self.config.num_hidden_layers = 1
        self.fuse = FeatureFuse(hidden, layers, config.rms_norm_eps)
        self.embed = torch.nn.Embedding(config.vocab_size, hidden)
        self.token_norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.feature_norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = HeadLayer(config)
        self.norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, len(vocab_ids), bias=False)
        # transformers' model modules take seconds to import: a coordinator that never builds a head skips them
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("vocab_ids", torch.tensor(vocab_ids, dtype=torch.long), persistent=False)
        self.embed.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @classmethod
    def from_verifier(cls, verifier: torch.nn.Module, layers: list[int], vocab_ids: list[int]) -> "FeatureHead":
        """Starts from the verifier: its embeddings and head rows (kept frozen), its last
        decoder layer and final norm, fc adding token and feature, fuse summing the depths."""
        head = cls(verifier.config, layers, vocab_ids)
        head._share(verifier)
        head.layer.load_from(verifier.model.layers[-1])
        hidden = verifier.config.hidden_size
        with torch.no_grad():
            head.norm.weight.copy_(verifier.model.norm.weight)
            head.fc.weight.copy_(torch.eye(hidden).repeat(1, 2))
        return head

    def _share(self, verifier: torch.nn.Module) -> None:
        with torch.no_grad():
            self.embed.weight.copy_(verifier.model.embed_tokens.weight)
            self.lm_head.weight.copy_(verifier.lm_head.weight[self.vocab_ids])

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, token_ids, features, position_ids, past_keys=None, past_values=None, mask=None):
        """token_ids (B, T), features (B, T, H) read with them, position_ids (B, T).
        Returns (outputs (B, T, H), keys, values of this pass)."""
        x = self.layer_input(token_ids, features)
        cos, sin = self.rotary(x, position_ids)
        return self.layer(x, cos[:, None], sin[:, None], past_keys, past_values, mask)

    def layer_input(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """What the decoder layer reads: fc over the normalised token embedding and feature."""
        parts = [self.token_norm(self.embed(token_ids)), self.feature_norm(features.to(self.embed.weight.dtype))]
        return self.fc(torch.cat(parts, dim=-1))

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (index i is token vocab_ids[i])."""
        return self.lm_head(self.norm(outputs))


def is_feature_head(source: str) -> bool:
    return (Path(resolve_alias(source)) / META).is_file()


def save_feature_head(directory: Path, head: FeatureHead, base_model: str, recipe: dict, dtype: str = "float16") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed.", "lm_head.", "rotary."))}
    save_file({k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in state.items()}, directory / WEIGHTS)
    (directory / VOCAB).write_text(json.dumps(head.vocab_ids.tolist()))
    meta = {"base_model": base_model, "verifier_layers": head.fuse.layers, "stored_dtype": dtype, "recipe": recipe}
    (directory / META).write_text(json.dumps(meta, indent=2))


def read_meta(source: str) -> dict:
    path = Path(resolve_alias(source))
    if not (path / META).is_file():
        raise FeatureHeadError(f"{source} is not a feature head: it lacks {META} (train one with specdec distill-feature-head)")
    return json.loads((path / META).read_text())


def feature_fingerprint(source: str) -> str:
    """The checkpoint's identity: a pair reads features only when both halves share it."""
    return hashlib.sha256((Path(resolve_alias(source)) / WEIGHTS).read_bytes()).hexdigest()[:32]


# The features travel as the drafter's verifier state (common.proto VerifierState), which the
# coordinator forwards unread: one float16 row of the verifier's width a position.
def state_name(source: str) -> str:
    """The verifier state (ModelInfo.verifier_state) the head of `source` reads, and its
    verifier fills: the features of this checkpoint's fuse."""
    return f"feature-head features, float16 rows, checkpoint {feature_fingerprint(source)}"


def features_to_state(start: int, rows: torch.Tensor) -> dict:
    """VerifierState fields for the features of positions start, start + 1, ..."""
    array = rows.detach().to(torch.float16).cpu().numpy().astype("<f2")
    return {"start": start, "positions": array.shape[0], "records": array.tobytes()}


def features_from_state(positions: int, records: bytes, width: int) -> torch.Tensor:
    """(positions, width) float32 rows from a VerifierState's records, or FeatureHeadError."""
    if len(records) != positions * width * 2:
        raise FeatureHeadError(
            f"verifier_state holds {len(records)} bytes for {positions} positions; features of width {width} "
            f"in float16 need {positions * width * 2}"
        )
    array = np.frombuffer(records, dtype="<f2")
    if not np.isfinite(array).all():
        raise FeatureHeadError("verifier_state holds NaN or infinite features")
    return torch.from_numpy(array.astype(np.float32)).view(positions, width)


def _state(source: str) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(Path(resolve_alias(source)) / WEIGHTS).items()}


def load_feature_fuse(source: str, verifier: torch.nn.Module) -> FeatureFuse:
    """The verifier's half: the fuse over the three depths the head was trained on."""
    meta = read_meta(source)
    hidden, layers = verifier.config.hidden_size, meta["verifier_layers"]
    fuse = FeatureFuse(hidden, layers, verifier.config.rms_norm_eps)
    weights = {k.removeprefix("fuse."): v for k, v in _state(source).items() if k.startswith("fuse.")}
    if weights["proj.weight"].shape != fuse.proj.weight.shape or max(layers) > verifier.config.num_hidden_layers:
        raise FeatureHeadError(
            f"{source}: a feature head for a verifier of width {weights['proj.weight'].shape[0]} reading layers {layers}; "
            f"this verifier has width {hidden} and {verifier.config.num_hidden_layers} layers"
        )
    fuse.load_state_dict(weights)
    return fuse.to(verifier.device).eval()  # fuses the verifier's own states where they are (a GPU)


def load_feature_head(source: str) -> tuple[FeatureHead, torch.nn.Module]:
    """The drafter's half (fuse included, unused there) and the base model it shares weights with."""
    meta = read_meta(source)
    base = load_model_weights_only(meta["base_model"], torch.float32)
    vocab_ids = json.loads((Path(resolve_alias(source)) / VOCAB).read_text())
    head = FeatureHead(base.config, meta["verifier_layers"], vocab_ids)
    head._share(base)
    missing, unexpected = head.load_state_dict(_state(source), strict=False)
    missing = [m for m in missing if not m.startswith(("embed.", "lm_head.", "rotary."))]
    if missing or unexpected:
        raise FeatureHeadError(f"{source}: checkpoint does not fit its base model (missing {missing}, unexpected {unexpected})")
    return head.eval().requires_grad_(False), base
