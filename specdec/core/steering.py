"""SD² steering (Berdoz et al., "Steering Pretrained Drafters during Speculative Decoding").

After each verification the verifier condenses its residual stream at three depths, at the
last position it has read, into one vector (`VerifierSteering`). That vector crosses the
wire as float16 bytes. The drafter normalises it and projects it to one delta per decoder
layer, added inside the SwiGLU up-branch, `down(silu(gate(x)) * (up(x) + delta_l))`, for
every token it feeds in its next draft (`DrafterSteering`). Models whose MLP is not SwiGLU
get the fallback: the delta is a bias added to the MLP's output.

Both halves are trained together by `specdec distill --steering` and stored in one file,
`steering.safetensors`, inside the drafter checkpoint; each service loads its own half.
"""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specdec.core.hub import resolve_alias

STEERING_FILE = "steering.safetensors"
STEERING_META = "steering.json"
SWIGLU, MLP_BIAS = "swiglu", "mlp-bias"


class SteeringError(ValueError):
    pass


def default_layers(num_layers: int) -> list[int]:
    """Three depths at about 10%, 50% and 95% of the verifier, as indices into
    `output_hidden_states` (0 = embeddings, i = the output of decoder layer i)."""
    picks = [max(1, round(num_layers * f)) for f in (0.1, 0.5, 0.95)]
    for i in (1, 2):  # keep them distinct on very shallow models
        picks[i] = max(picks[i], picks[i - 1] + 1)
    if picks[2] > num_layers:
        raise SteeringError(f"steering needs a verifier with at least 3 layers, this one has {num_layers}")
    return picks


class VerifierSteering(torch.nn.Module):
    """Linear(3H -> H) over the residual stream at three layers, initialised as three stacked
    identities (so it starts as their sum)."""

    def __init__(self, hidden_size: int, layers: list[int]):
        super().__init__()
        if len(layers) != 3:
            raise SteeringError(f"steering reads exactly 3 verifier layers, got {layers}")
        self.layers = list(layers)
        self.proj = torch.nn.Linear(3 * hidden_size, hidden_size, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(hidden_size).repeat(1, 3))

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.proj(torch.cat([hidden_states[i] for i in self.layers], dim=-1))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Llama-style (model.layers) or GPT-2-style (transformer.h) causal LM."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
        raise SteeringError(f"cannot find the decoder layers' MLPs of model type '{model.config.model_type}' to steer")
    return layers


def injection_kind(model: torch.nn.Module) -> str:
    mlp = decoder_layers(model)[0].mlp
    return SWIGLU if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) else MLP_BIAS


class DrafterSteering(torch.nn.Module):
    """LayerNorm(H_v), then Linear(H_v -> width * n_layers), zero-initialised, so an untrained
    steering leaves the drafter exactly as it was. `attach` hooks the deltas into a model;
    `steer(vectors)` turns them on for the forwards inside it."""

    def __init__(self, steering_size: int, num_layers: int, width: int, kind: str):
        super().__init__()
        self.kind, self.num_layers, self.width = kind, num_layers, width
        self.norm = torch.nn.LayerNorm(steering_size)
        self.proj = torch.nn.Linear(steering_size, width * num_layers)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)
        self._deltas: list[torch.Tensor] | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, steering_size: int) -> "DrafterSteering":
        kind = injection_kind(model)
        width = model.config.intermediate_size if kind == SWIGLU else model.config.hidden_size
        return cls(steering_size, len(decoder_layers(model)), width, kind)

    def attach(self, model: torch.nn.Module) -> None:
        layers = decoder_layers(model)
        if len(layers) != self.num_layers or injection_kind(model) != self.kind:
            raise SteeringError(f"this steering was made for {self.num_layers} {self.kind} layers; the drafter differs")
        for index, layer in enumerate(layers):
            target = layer.mlp.up_proj if self.kind == SWIGLU else layer.mlp
            target.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def add_delta(module, inputs, output):
            delta = self.delta(index)
            return None if delta is None else output + delta.to(output.dtype)

        return add_delta

    def delta(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s delta while steering is on (None otherwise): what an engine that runs
        its own forward adds to the up-branch, as the hooks do for transformers' modules."""
        return None if self._deltas is None else self._deltas[layer]

    def deltas(self, vectors: torch.Tensor) -> torch.Tensor:
        """(..., H_v) -> (..., n_layers, width)."""
        out = self.proj(self.norm(vectors.to(self.proj.weight.dtype)))
        return out.unflatten(-1, (self.num_layers, self.width))

    @contextmanager
    def steer(self, vectors: torch.Tensor | None, present: torch.Tensor | None = None):
        """Forwards inside are steered by `vectors`: one (H_v,) vector for every position, or
        (batch, positions, H_v) for each its own. `present` (batch, positions) marks the
        positions that have a vector; the others are not steered. None = no steering."""
        if vectors is None:
            yield
            return
        deltas = self.deltas(vectors)
        if present is not None:
            deltas = deltas * present[..., None, None].to(deltas.dtype)
        with self.applied(list(deltas.unbind(-2))):
            yield

    @contextmanager
    def applied(self, layer_deltas: list[torch.Tensor]):
        """Forwards inside add these per-layer deltas (made once by `deltas`, used for many
        forwards)."""
        self._deltas = layer_deltas
        try:
            yield
        finally:
            self._deltas = None


def sample_offsets(present: torch.Tensor, max_offset: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For training: drafter position t is steered by the verifier's position t - o, o ~ U{1..k}.
    Returns (source index per position, whether that source exists)."""
    batch, width = present.shape
    offsets = torch.randint(1, max_offset + 1, (batch, width), generator=generator)
    source = torch.arange(width)[None, :] - offsets
    return source.clamp_min(0), (source >= 0) & present


def round_offsets(width: int, max_offset: int) -> torch.Tensor:
    """Offsets 1, 2, ..., k, 1, 2, ... along `width` positions: each position's place in rounds of k drafts."""
    return torch.arange(width) % max_offset + 1


def cycled_offsets(batch: int, width: int, max_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For evaluation: offsets as in rounds of k drafts (`round_offsets`), each steered by the
    position before the round."""
    source = torch.arange(width) - round_offsets(width, max_offset)
    return source.clamp_min(0)[None].expand(batch, width), (source >= 0)[None].expand(batch, width)


def gather_steering(vectors: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """vectors (batch, positions, H) picked at source (batch, positions)."""
    return vectors.gather(1, source[..., None].expand(-1, -1, vectors.shape[-1]))


# Checkpoint: both halves in one file, plus what each side needs to rebuild its module.


def save_steering(
    directory: Path, verifier: str, verifier_part: VerifierSteering, drafter_part: DrafterSteering, max_offset: int, dtype: str = "float16"
) -> None:
    state = {f"verifier.{k}": v for k, v in verifier_part.state_dict().items()}
    state |= {f"drafter.{k}": v for k, v in drafter_part.state_dict().items()}
    save_file({k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in state.items()}, directory / STEERING_FILE)
    meta = {
        "verifier": verifier,  # the model the verifier half was trained on
        "verifier_layers": verifier_part.layers,
        "steering_size": verifier_part.proj.out_features,
        "drafter_layers": drafter_part.num_layers,
        "width": drafter_part.width,
        "injection": drafter_part.kind,
        "max_offset": max_offset,
    }
    (directory / STEERING_META).write_text(json.dumps(meta, indent=2))


def is_steering_checkpoint_for(directory: str, verifier: str) -> bool:
    """Whether `directory` holds a steering checkpoint trained with this verifier."""
    path = Path(resolve_alias(directory))
    if not (path / STEERING_FILE).is_file() or not (path / STEERING_META).is_file():
        return False
    return json.loads((path / STEERING_META).read_text()).get("verifier") == verifier


def _read(directory: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    path = Path(resolve_alias(directory))
    if not (path / STEERING_FILE).is_file() or not (path / STEERING_META).is_file():
        raise SteeringError(
            f"{directory} is not a steering checkpoint: it lacks {STEERING_FILE} and {STEERING_META} "
            "(train one with specdec distill --steering)"
        )
    raw = (path / STEERING_FILE).read_bytes()
    return json.loads((path / STEERING_META).read_text()), load_file(path / STEERING_FILE), hashlib.sha256(raw).hexdigest()[:32]


def load_verifier_steering(directory: str, model: torch.nn.Module) -> tuple[VerifierSteering, str]:
    """The verifier's half and the checkpoint's fingerprint (both halves must share it)."""
    meta, state, fingerprint = _read(directory)
    state = {k: v.float() for k, v in state.items()}
    hidden, layers = model.config.hidden_size, meta["verifier_layers"]
    if meta["steering_size"] != hidden or max(layers) > model.config.num_hidden_layers:
        raise SteeringError(
            f"{directory}: steering made for a verifier of width {meta['steering_size']} reading layers {layers}; "
            f"this verifier has width {hidden} and {model.config.num_hidden_layers} layers"
        )
    part = VerifierSteering(hidden, layers)
    part.load_state_dict({k.removeprefix("verifier."): v for k, v in state.items() if k.startswith("verifier.")})
    return part.to(model.dtype).eval(), fingerprint


def load_drafter_steering(directory: str, model: torch.nn.Module) -> tuple[DrafterSteering, str]:
    """The drafter's half, attached to `model`, and the checkpoint's fingerprint."""
    meta, state, fingerprint = _read(directory)
    state = {k: v.float() for k, v in state.items()}
    part = DrafterSteering(meta["steering_size"], meta["drafter_layers"], meta["width"], meta["injection"])
    part.load_state_dict({k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")})
    part = part.to(model.dtype).eval()
    part.attach(model)
    return part, fingerprint


# Wire form: a common.Tensor of float16 bytes with its shape.


def vector_to_tensor_fields(vector: torch.Tensor) -> dict:
    array = vector.detach().to(torch.float16).cpu().numpy()
    return {"shape": list(array.shape), "dtype": "float16", "data": array.astype("<f2").tobytes()}


def vector_from_tensor(message, expected_size: int) -> torch.Tensor:
    """The steering vector from a common.Tensor, or SteeringError saying what is wrong."""
    if message.dtype not in ("float16", "float32"):
        raise SteeringError(f"steering.dtype must be float16 or float32, got '{message.dtype}'")
    if list(message.shape) != [expected_size]:
        raise SteeringError(f"steering.shape must be [{expected_size}], got {list(message.shape)}")
    item = 2 if message.dtype == "float16" else 4
    if len(message.data) != expected_size * item:
        raise SteeringError(
            f"steering.data has {len(message.data)} bytes; shape [{expected_size}] of {message.dtype} needs {expected_size * item}"
        )
    array = np.frombuffer(message.data, dtype="<f2" if item == 2 else "<f4")
    if not np.isfinite(array).all():
        raise SteeringError("steering.data holds NaN or infinite values")
    return torch.from_numpy(array.astype(np.float32))
