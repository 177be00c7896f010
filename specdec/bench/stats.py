"""Paired intervals for ratios measured on the same prompts."""
from __future__ import annotations

import random


def paired_ratio_interval(
    treated: tuple[list[float], list[float]], control: tuple[list[float], list[float]], draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95% paired-bootstrap interval of (sum num / sum den) of `treated` over that of
    `control`, each given as (numerators, denominators) per prompt. Prompts are resampled with
    replacement, the same draw for both (they decoded the same prompts)."""
    n = len(treated[0])
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        rates = [sum(num[i] for i in picks) / max(sum(den[i] for i in picks), 1e-12) for num, den in (treated, control)]
        if rates[1] > 0:
            ratios.append(rates[0] / rates[1])
    ratios.sort()
    return ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]
