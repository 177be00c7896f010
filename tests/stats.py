"""A chi-square goodness-of-fit check for the exactness tests, and the power it has."""
from __future__ import annotations

import torch
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2


def _pooled(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed and expected counts, cells expected to hold fewer than 5 draws pooled into one,
    as the test requires."""
    counts = counts.double().flatten()
    n = counts.sum()
    expected = expected_probs.double().flatten() / expected_probs.sum() * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    return obs[keep], exp[keep]


def assert_matches_distribution(counts: torch.Tensor, expected_probs: torch.Tensor, alpha: float = 1e-3) -> None:
    """Pearson chi-square of observed counts against exact probabilities."""
    impossible = counts.double().flatten()[expected_probs.double().flatten() == 0].sum()
    assert impossible == 0, f"{int(impossible)} draws fell where the target distribution has no mass"
    obs, exp = _pooled(counts, expected_probs)
    n = obs.sum()
    statistic = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    p_value = float(chi2.sf(statistic, dof))
    tvd = 0.5 * float((obs / n - exp / n).abs().sum())
    assert p_value > alpha, f"chi-square {statistic:.1f} on {dof} dof (p = {p_value:.2e}, TVD = {tvd:.3f}): not the target distribution"


def detectable_tvd(draws: int, expected_probs: torch.Tensor, alpha: float = 1e-3, power: float = 0.5) -> float:
    """The smallest total variation distance the check above catches with probability `power`
    in the worst case: mass moved between the two likeliest cells (the noncentrality of moving
    d between cells of probabilities a and b is draws * d**2 * (1/a + 1/b), smallest there).
    The docstrings of the statistical tests quote it."""
    obs, exp = _pooled(expected_probs.double() * draws, expected_probs)
    dof = len(exp) - 1
    critical = chi2.isf(alpha, dof)
    noncentrality = brentq(lambda lam: ncx2.sf(critical, dof, lam) - power, 1e-6, 1e6)
    a, b = torch.topk(exp / draws, 2).values.tolist()
    return (noncentrality / (draws * (1 / a + 1 / b))) ** 0.5
