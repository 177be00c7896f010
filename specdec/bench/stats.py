"""Paired intervals for ratios measured on the same prompts, or in the same rounds of turns."""
from __future__ import annotations

import math
import random
import statistics


def turn_order(items: list, index: int) -> list:
    """The order in which the methods (or policies) take their turns on prompt `index`: rotated
    by one place a prompt, so that each takes every place in the order alike (in a fixed order a
    row measured 1.09x over the very same rounds as another, by its place alone). Who runs right
    before whom stays cyclic; the concurrency bench's `turns` balances that too, for 3 policies."""
    shift = index % len(items)
    return items[shift:] + items[:shift]


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


def paired_geometric_mean(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of ratios each measured side by side (a treated and a control run
    close in time), and its 95% bootstrap interval: (mean, low, high). Pairing cancels the
    machine's drift between pairs, which a ratio of totals would keep."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
    return math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * draws)]), math.exp(means[int(0.975 * draws) - 1])
