"""Measured step costs: how long one forward pass over b new tokens takes.

The cost curve c(b) of the target decides what a verification of k draft
tokens (b = k + 1) costs relative to one plain step (b = 1); on a CPU it is
far from flat (memory-bound at b = 1, compute-bound as b grows).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch


def forward_cost_curve(
    model,
    context_ids: Sequence[int],
    sizes: Sequence[int],
    repeats: int = 3,
) -> dict[int, float]:
    """Median seconds of one `forward` over b new tokens after `context_ids` are cached.

    Each size runs once untimed first (kernel selection for a new shape), then
    `repeats` timed passes, rolling the cache back each time. The cache is left
    holding `context_ids`.
    """
    model.prefill(torch.tensor(list(context_ids)))
    base = model.cached_len
    feed = torch.tensor((list(context_ids) * (max(sizes) // max(1, len(context_ids)) + 1))
                        [:max(sizes)])  # [max(sizes)] int64
    curve = {}
    for b in sizes:
        times = []
        for r in range(repeats + 1):
            model.rollback(base)
            start = time.perf_counter()
            model.forward(feed[:b], last_n=b)
            if r:
                times.append(time.perf_counter() - start)
        curve[b] = statistics.median(times)
    model.rollback(base)
    return curve


def default_sizes(max_k: int) -> list[int]:
    """Batch sizes to measure for verifications of up to max_k draft tokens."""
    sizes = set(range(1, min(max_k + 1, 9) + 1))
    sizes |= {b for b in (11, 13, 17, 21, 25, 33) if b <= max_k + 1}
    sizes.add(max_k + 1)
    return sorted(sizes)
