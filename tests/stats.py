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


def exact_joint(verifier, prompt: list[int], eos: int, sampling, length: int) -> dict[tuple[int, ...], float]:
    """The verifier's own probability of each sequence of its first `length` tokens after
    `prompt` (a sequence that ends with `eos` stops there), over every sequence it can produce."""
    from specdec.core.sampling import warp_probs

    joint = {(): 1.0}
    for _ in range(length):
        open_ = [seq for seq in joint if not seq or seq[-1] != eos]
        if not open_:
            break
        with torch.inference_mode():
            logits = verifier(torch.tensor([prompt + list(seq) for seq in open_])).logits[:, -1]
        probs = warp_probs(logits, sampling)
        grown = {seq: p for seq, p in joint.items() if seq and seq[-1] == eos}
        for seq, row in zip(open_, probs):
            support = torch.nonzero(row > 0).flatten().tolist()
            grown.update({seq + (t,): joint[seq] * float(row[t]) for t in support})
        joint = {seq: p for seq, p in grown.items() if p > 1e-9 or len(seq) < length}
    return joint


def check_sequences(sequences: list[tuple[int, ...]], joint: dict[tuple[int, ...], float], draws: int) -> float:
    """Chi-square of the sampled sequences against `joint`; returns the TVD it detects."""
    cells = list(joint) + sorted(set(sequences) - set(joint))  # sequences the verifier can't produce: probability 0
    index = {seq: i for i, seq in enumerate(cells)}
    counts = torch.zeros(len(cells))
    for seq in sequences:
        counts[index[seq]] += 1
    probs = torch.tensor([joint.get(seq, 0.0) for seq in cells], dtype=torch.float64)
    assert_matches_distribution(counts, probs)
    return detectable_tvd(draws, probs)


def sampled_through(stack, prompt: list[int], draws: int, sampling, length: int, min_accepted: float, **request) -> list[tuple[int, ...]]:
    """The first `length` tokens of `draws` sampled answers (seeds 0, 1, ...) through a running
    stack's coordinator; the drafts must have kept at least `min_accepted` tokens a draw, or
    the test would say little about speculation."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.serving.client import CoordinatorClient, generate_request

    client = CoordinatorClient(stack["coordinator"])
    requests = [
        generate_request(prompt_token_ids=prompt, max_new_tokens=length, temperature=sampling.temperature, top_p=sampling.top_p,
                         top_k=sampling.top_k, seed=seed, **request)
        for seed in range(draws)
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(client.generate, requests))
    client.close()
    assert sum(a.stats.accepted_draft_tokens for a in answers) > draws * min_accepted, "the drafts were rarely accepted: a weak test"
    return [tuple(a.token_ids[:length]) for a in answers]
