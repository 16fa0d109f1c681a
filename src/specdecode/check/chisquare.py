"""Chi-square goodness of fit without scipy (a user command must not need the test extra)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor,  # [V] observed counts
                      probs: torch.Tensor,  # [V] float probabilities they should follow
                      ) -> float:
    """P(chi2 >= observed statistic) with bins expecting fewer than 5 draws pooled
    into one; 0.0 when a draw landed on a token of probability 0."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * n
    small = expected < 5
    exp = torch.cat((expected[~small], expected[small].sum().reshape(1)))
    obs = torch.cat((counts[~small], counts[small].sum().reshape(1)))
    keep = exp > 0
    exp, obs = exp[keep], obs[keep]
    if exp.numel() < 2:
        return 1.0
    statistic = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(exp.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))
