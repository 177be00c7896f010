"""Distilled drafter checkpoints: a directory that drafter_service loads directly.

Layout:
  specdec_drafter.json   base model (tokenizer and shared weights), layers, draft vocabulary, recipe
  config.json            the student's transformers config
  model.safetensors      the student's own weights (shared embeddings/head are not stored twice)
  draft_vocab.json       the token ids the student's head predicts (absent = full vocabulary)

A reduced draft vocabulary is still a valid proposal: the drafter puts zero probability on
every other token, and verification stays exact.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from specdec.core.hub import load_model_weights_only

MARKER = "specdec_drafter.json"
SHARED_PREFIXES = ("model.embed_tokens.", "lm_head.")


def is_drafter_checkpoint(source: str) -> bool:
    return (Path(source) / MARKER).is_file()


def read_meta(directory: str) -> dict:
    return json.loads((Path(directory) / MARKER).read_text())


def base_model_of(directory: str) -> str:
    return read_meta(directory)["base_model"]


def build_student(teacher: torch.nn.Module, layers: list[int], vocab_ids: list[int] | None) -> torch.nn.Module:
    """A drafter made of some of the teacher's decoder layers, its embeddings, final norm and
    head (cut to vocab_ids when given). Weights are copies; the caller decides what trains."""
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [teacher.config.layer_types[i] for i in layers]
    config.tie_word_embeddings = False
    student = AutoModelForCausalLM.from_config(config, dtype=teacher.dtype)
    student.model.embed_tokens.load_state_dict(teacher.model.embed_tokens.state_dict())
    student.model.norm.load_state_dict(teacher.model.norm.state_dict())
    for target, index in zip(student.model.layers, layers):
        target.load_state_dict(teacher.model.layers[index].state_dict())
    set_head(student, _cut(teacher.lm_head.weight.detach(), vocab_ids), vocab_ids)
    return student


def _cut(full_head: torch.Tensor, vocab_ids: list[int] | None) -> torch.Tensor:
    return full_head if vocab_ids is None else full_head[torch.tensor(vocab_ids)]


def set_head(student: torch.nn.Module, rows: torch.Tensor, vocab_ids: list[int] | None) -> None:
    """Gives the student a head over vocab_ids (None = all tokens) with these weight rows."""
    head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
    head.weight.data.copy_(rows)
    student.lm_head = head
    student.draft_vocab_ids = None if vocab_ids is None else torch.tensor(vocab_ids, dtype=torch.long)


def save_drafter(
    out_dir: Path, student: torch.nn.Module, base_source: str, layers: list[int], shared: bool, recipe: dict, dtype: str = "float16"
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to(getattr(torch, dtype)).contiguous()
        for k, v in student.state_dict().items()
        if not (shared and k.startswith(SHARED_PREFIXES))
    }
    save_file(state, out_dir / "model.safetensors")
    student.config.save_pretrained(out_dir)
    vocab_ids = getattr(student, "draft_vocab_ids", None)
    if vocab_ids is not None:
        (out_dir / "draft_vocab.json").write_text(json.dumps(vocab_ids.tolist()))
    meta = {"base_model": base_source, "layers": layers, "shared_embeddings": shared, "stored_dtype": dtype, "recipe": recipe}
    (out_dir / MARKER).write_text(json.dumps(meta, indent=2))


class ScatteredHead(torch.nn.Module):
    """A head over a reduced draft vocabulary that still answers in full-vocabulary logits
    (-inf outside it), so the drafter looks like any causal LM to its callers (drafter_service,
    Hugging Face assisted generation) while paying only for the reduced matrix product."""

    def __init__(self, head: torch.nn.Linear, vocab_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head = head
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.head(hidden)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.vocab_ids] = small
        return full


def load_drafter(directory: str, dtype: torch.dtype, scattered_head: bool = True) -> tuple[torch.nn.Module, str]:
    """Returns the student and the base model source (its tokenizer and shared weights).
    Without `scattered_head`, a reduced-vocabulary head answers over its own vocabulary
    (`student.draft_vocab_ids`), as distillation trains it."""
    path = Path(directory)
    meta = read_meta(directory)
    config = AutoConfig.from_pretrained(path)
    student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    vocab_file = path / "draft_vocab.json"
    vocab_ids = json.loads(vocab_file.read_text()) if vocab_file.is_file() else None
    state = {k: v.to(dtype) for k, v in load_file(path / "model.safetensors").items()}
    if meta["shared_embeddings"]:
        base = load_model_weights_only(meta["base_model"], dtype)
        state["model.embed_tokens.weight"] = base.model.embed_tokens.weight.detach()
        head_rows = _cut(base.lm_head.weight.detach(), vocab_ids)
    else:
        head_rows = state["lm_head.weight"]  # stored already cut to the draft vocabulary
    set_head(student, head_rows, vocab_ids)
    state.pop("lm_head.weight", None)
    missing, unexpected = student.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head.")]:
        raise ValueError(f"{directory}: checkpoint does not fit its config (missing {missing}, unexpected {unexpected})")
    if vocab_ids is not None and scattered_head:
        student.lm_head = ScatteredHead(student.lm_head, student.draft_vocab_ids, config.vocab_size)
    return student, meta["base_model"]


def scatter_head(model: torch.nn.Module, vocab_ids: list[int]) -> None:
    """Cuts a model's head to the rows of vocab_ids; it still answers in full-vocabulary logits
    (-inf elsewhere), and `model.draft_vocab_ids` says which."""
    set_head(model, model.lm_head.weight.detach()[torch.tensor(vocab_ids)], vocab_ids)
    model.lm_head = ScatteredHead(model.lm_head, model.draft_vocab_ids, model.config.vocab_size)
