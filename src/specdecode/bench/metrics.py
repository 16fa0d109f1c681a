"""Benchmark arithmetic: README.md's Metrics section made into functions (no models, no timing).

Costs are in units of one plain target step (one target forward over one
token): c_draft per draft token, c_verify(b) per verification pass over b
tokens (the pending token plus the draft).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def expected_tokens_per_step(alpha: float, k: float) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per step for a chain of k with i.i.d. alpha
    (Leviathan et al. 2023); k may be fractional (a mean draft length)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: float, c_draft: float, c_verify: float) -> float:
    """Speedup the measured alpha and costs allow: tokens per step / cost per step."""
    return expected_tokens_per_step(alpha, k) / (k * c_draft + c_verify)


def break_even_acceptance(k: int, c_draft: float, c_verify: float) -> float | None:
    """The acceptance alpha at which drafting k tokens per step is as fast as plain
    decoding (theoretical_speedup = 1); below it speculation loses and the engine's
    collapse guard (collapse.py) turns it off. None: it loses even at alpha = 1."""
    if theoretical_speedup(1.0, k, c_draft, c_verify) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):  # bisection: the speedup grows with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if theoretical_speedup(mid, k, c_draft, c_verify) < 1.0 else (
            lo, mid)
    return hi


def expected_tokens_from_positions(position_acceptance: Sequence[float], k: int) -> float:
    """1 + sum_i prod_{j<=i} a_j: tokens per step from per-position acceptance
    (no i.i.d. assumption); positions past the measured ones reuse the last value."""
    tokens, reach = 1.0, 1.0
    for i in range(k):
        if position_acceptance:
            a = position_acceptance[min(i, len(position_acceptance) - 1)]
        else:
            a = 0.0
        reach *= a
        tokens += reach
    return tokens


def replay_speedup(
    drafted_per_step: Sequence[int],
    accepted_per_step: Sequence[int],
    k: int,
    c_draft: float,
    c_verify: dict[int, float],
) -> float:
    """Predicted speedup at draft length k, replaying steps measured at a longer k.

    Each measured step becomes a step that drafts min(drafted, k) tokens and
    keeps min(accepted, k) plus one recovered/bonus token; its cost is
    drafted * c_draft + c_verify(drafted + 1). An estimate: it assumes the
    drafter would have proposed the same prefixes at the shorter length.
    """
    tokens = cost = 0.0
    for drafted, accepted in zip(drafted_per_step, accepted_per_step):
        d = min(drafted, k)
        tokens += min(accepted, k) + 1
        cost += d * c_draft + interpolate(c_verify, d + 1)
    return tokens / cost if cost else 0.0


def interpolate(curve: dict[int, float], b: int) -> float:
    """Value of a cost curve (batch size -> cost) at b, linear between measured points,
    linear extrapolation from the last two past the end."""
    if b in curve:
        return curve[b]
    xs = sorted(curve)
    if b < xs[0]:
        return curve[xs[0]]
    lo = max((x for x in xs if x < b), default=xs[0])
    hi = min((x for x in xs if x > b), default=None)
    if hi is None:
        if len(xs) == 1:
            return curve[lo] * b / lo
        lo, hi = xs[-2], xs[-1]
    return curve[lo] + (curve[hi] - curve[lo]) * (b - lo) / (hi - lo)


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (or where one ends); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the values."""
    return statistics.median(values), min(values), max(values)


def step_costs(plain_step_seconds: float, draft_time: float, verify_time: float,
               drafted: int, steps: int) -> tuple[float, float]:
    """(c_draft per draft token, c_verify per pass) of a run, in plain target steps."""
    if plain_step_seconds <= 0 or steps == 0:
        return 0.0, 0.0
    c_draft = draft_time / drafted / plain_step_seconds if drafted else 0.0
    return c_draft, verify_time / steps / plain_step_seconds
