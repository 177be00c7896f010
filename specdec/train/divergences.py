"""Divergences between a teacher (verifier) and a student (drafter) next-token distribution,
per position, from logits. Pure functions; DistillSpec picks one per decoding mode.

All take log-probabilities over the same support (last dim) and return one value per
position. Acceptance of a sampled draft token is 1 - TVD(p, q)."""
from __future__ import annotations

import math

import torch

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")
_LOG_FLOOR = -1e4


def forward_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q): mode covering; the student must cover everything the teacher might say."""
    # Clamping keeps 0 * log 0 at 0 (and gradients finite) where a probability is exactly zero.
    teacher_logp, student_logp = teacher_logp.clamp_min(_LOG_FLOOR), student_logp.clamp_min(_LOG_FLOOR)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


def reverse_kl(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """KL(q || p): mode seeking; the student concentrates on what the teacher likes most."""
    return forward_kl(student_logp, teacher_logp)


def jensen_shannon(teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised JSD(β) = β KL(p || m) + (1 - β) KL(q || m), m = β p + (1 - β) q."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    mixture = torch.logaddexp(teacher_logp + math.log(beta), student_logp + math.log(1.0 - beta))
    return beta * forward_kl(teacher_logp, mixture) + (1.0 - beta) * forward_kl(student_logp, mixture)


def total_variation(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """TVD(p, q) = ½ Σ |p − q| = 1 − acceptance probability of a sampled draft."""
    return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(-1)


def divergence(name: str, teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    if name == "fkl":
        return forward_kl(teacher_logp, student_logp)
    if name == "rkl":
        return reverse_kl(teacher_logp, student_logp)
    if name == "jsd":
        return jensen_shannon(teacher_logp, student_logp, beta)
    if name == "tvd":
        return total_variation(teacher_logp, student_logp)
    raise ValueError(f"unknown divergence '{name}'; choose one of {', '.join(DIVERGENCES)}")
