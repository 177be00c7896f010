"""The bench's paired intervals (scipy's bootstrap, prompts resampled jointly)."""
from __future__ import annotations

import pytest

from specdec.bench.stats import paired_geometric_mean, paired_ratio_interval


def test_a_ratio_interval_holds_the_ratio_and_pairs_the_prompts():
    # Prompts of very different lengths, the treated method 2x faster on every one: pairing
    # makes the interval exactly 2 (unpaired draws would spread it by the lengths).
    tokens, seconds = [10, 200, 50, 400], [1.0, 30.0, 4.0, 70.0]
    low, high = paired_ratio_interval((tokens, [s / 2 for s in seconds]), (tokens, seconds))
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
    noisy = [s * f for s, f in zip(seconds, (0.4, 0.6, 0.5, 0.55))]
    low, high = paired_ratio_interval((tokens, noisy), (tokens, seconds))
    point = sum(tokens) / sum(noisy) / (sum(tokens) / sum(seconds))
    assert low < point < high and 1.5 < low and high < 2.6
    assert paired_ratio_interval(([5], [1.0]), ([5], [2.0])) == (2.0, 2.0)  # one prompt: nothing to resample


def test_a_geometric_mean_interval_holds_the_mean():
    mean, low, high = paired_geometric_mean([0.9, 1.1, 1.0, 1.05, 0.95])
    assert low < mean < high and mean == pytest.approx(0.9984, abs=1e-3)
    assert paired_geometric_mean([1.2]) == pytest.approx((1.2, 1.2, 1.2))
