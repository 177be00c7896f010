"""A chi-square goodness-of-fit check for the exactness tests."""
from __future__ import annotations

import torch
from scipy.stats import chi2


def assert_matches_distribution(counts: torch.Tensor, expected_probs: torch.Tensor, alpha: float = 1e-3) -> None:
    """Pearson chi-square of observed counts against exact probabilities. Cells expected to
    hold fewer than 5 draws are pooled into one, as the test requires."""
    counts = counts.double().flatten()
    n = counts.sum()
    expected = expected_probs.double().flatten() / expected_probs.sum() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    p_value = float(chi2.sf(statistic, dof))
    tvd = 0.5 * float((obs / n - exp / n).abs().sum())
    assert p_value > alpha, f"chi-square {statistic:.1f} on {dof} dof (p = {p_value:.2e}, TVD = {tvd:.3f}): not the target distribution"
