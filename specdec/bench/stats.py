"""Paired intervals for ratios measured on the same prompts, or in the same rounds of turns."""
from __future__ import annotations

import numpy as np
from scipy.stats import bootstrap


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

    def ratio(treated_num, treated_den, control_num, control_den, axis=-1):
        return (treated_num.sum(axis) / treated_den.sum(axis)) / (control_num.sum(axis) / control_den.sum(axis))

    samples = [np.asarray(values, dtype=float) for values in (*treated, *control)]
    if len(samples[0]) < 2:  # nothing to resample: the ratio itself
        point = float(ratio(*samples))
        return point, point
    return _percentile_interval(samples, ratio, draws, seed)


def paired_geometric_mean(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of ratios each measured side by side (a treated and a control run
    close in time), and its 95% bootstrap interval: (mean, low, high). Pairing cancels the
    machine's drift between pairs, which a ratio of totals would keep."""
    logs = np.log(np.asarray(ratios, dtype=float))
    if len(logs) < 2:
        return (float(np.exp(logs.mean())),) * 3
    low, high = _percentile_interval([logs], lambda x, axis=-1: x.mean(axis), draws, seed)
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def _percentile_interval(samples: list[np.ndarray], statistic, draws: int, seed: int) -> tuple[float, float]:
    """scipy's bootstrap, resampling the samples' observations jointly (paired), percentile method."""
    result = bootstrap(samples, statistic, paired=True, vectorized=True, n_resamples=draws, method="percentile", random_state=seed)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
