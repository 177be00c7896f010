"""What the two trainers (distill.py, feature_head.py) share: the files they write while they run
(sample caches, the resumable checkpoint) and their optimizer step and schedule."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from specdec.serving.config import ConfigError


def atomic_save(obj, path: Path) -> None:
    """torch.save that a kill mid-write cannot leave half-written: the old file stays until the new one is whole."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.rename(path)


def load_or_make(path: Path, settings: dict, make, weights_only: bool = True) -> dict:
    """The dict cached at `path` if it was made with these `settings`, else `make()` (with the
    settings added), saved there first. Sample caches: making them is the slow part of a run."""
    data = torch.load(path, weights_only=weights_only) if path.is_file() else None
    if data is None or data.get("settings") != settings:
        data = make() | {"settings": settings}
        atomic_save(data, path)
    return data


def warmup_then_linear(optimizer: torch.optim.Optimizer, steps: int, floor: float) -> torch.optim.lr_scheduler.LambdaLR:
    """20 warm-up steps, then the learning rate falls linearly to `floor` of itself at `steps`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(floor, 1 - s / steps))


def train_step(loss: torch.Tensor, trainable: list, optimizer: torch.optim.Optimizer, schedule) -> None:
    """One optimizer step on `loss`, the gradients clipped to norm 1."""
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    schedule.step()


class Checkpoint:
    """A run's resumable state in `out`/checkpoint.pt: the recipe it was made with, the step, the
    history, the optimizer and schedule, the random generators (Python's, torch's and
    `generator`), and whatever the trainer adds (its modules' weights, the evaluation before)."""

    def __init__(self, out: Path, recipe: dict, optimizer, schedule, generator: torch.Generator | None = None):
        self.path, self.recipe = out / "checkpoint.pt", recipe
        self.optimizer, self.schedule, self.generator = optimizer, schedule, generator

    def resume(self) -> dict | None:
        """The saved state, with the optimizer, schedule and generators already restored from it
        (the trainer loads its own entries); None: no checkpoint, a fresh start."""
        if not self.path.is_file():
            return None
        state = torch.load(self.path, weights_only=False)
        if state["config"] != self.recipe:
            raise ConfigError(f"{self.path} was made with another recipe; use a new --out or delete it")
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if self.generator is not None:
            self.generator.set_state(state["generator"])
        print(f"resuming from step {state['step']}")
        return state

    def save(self, **entries) -> None:
        atomic_save({
            "config": self.recipe, **entries, "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
            "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(),
            **({"generator": self.generator.get_state()} if self.generator is not None else {}),
        }, self.path)
