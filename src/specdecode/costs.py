"""Measured step costs: how long one forward pass over b new tokens takes.

The cost curve c(b) of the target decides what a verification of k draft
tokens (b = k + 1) costs relative to one plain step (b = 1); on a CPU it is
far from flat (memory-bound at b = 1, compute-bound as b grows).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.speclen import CostModel


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


MONOTONE_SLACK = 1.15  # c(b) may exceed a larger batch's cost by this much (noise)
DRIFT_SLACK = 0.2  # a plain step measured again at the end may differ by this much


def disturbed_points(curve: dict[int, float]) -> set[int]:
    """Sizes b whose cost exceeds a larger size's by more than the slack: one of the
    two was measured while something else ran (the pass itself cannot be slower
    for fewer tokens)."""
    sizes, bad = sorted(curve), set()
    for i, b in enumerate(sizes):
        for b2 in sizes[i + 1:]:
            if curve[b] > MONOTONE_SLACK * curve[b2]:
                bad |= {b, b2}
    return bad


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The curve with each c(b) lowered to the cheapest cost of any larger size: a
    spike (a disturbed measurement) is dropped, and an optimistic error is one the
    controller corrects by observing the steps it then takes."""
    out, low = {}, float("inf")
    for b in sorted(curve, reverse=True):
        low = min(low, curve[b])
        out[b] = low
    return dict(sorted(out.items()))


BUSY_CORES = 0.25  # other processes' CPU use during a measurement that disturbs it


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall, CPU seconds busy on the whole machine, CPU seconds of this process), or
    None where /proc/stat cannot be read."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is in user
    own = os.times()
    return time.monotonic(), busy, own.user + own.system


def others_busy(before: tuple[float, float, float] | None) -> float:
    """Average cores other processes kept busy since `before` (0 where unknown)."""
    after = _cpu_seconds()
    if before is None or after is None or after[0] <= before[0]:
        return 0.0
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0])


def measure_curve(model, context_ids: Sequence[int], sizes: Sequence[int],
                  rounds: int = 3) -> tuple[dict[int, float], bool]:
    """(c(b) in seconds, clean): medians of repeated passes; sizes that break
    monotonicity are measured again (up to `rounds` times), and a plain step is
    measured again at the end. clean: no check failed at the end and other
    processes kept less than BUSY_CORES busy meanwhile (only a clean curve may
    be cached); an unclean one is returned made monotone."""
    start = _cpu_seconds()
    curve = forward_cost_curve(model, context_ids, sizes)
    for _ in range(rounds):
        bad = disturbed_points(curve)
        if not bad:
            break
        curve.update(forward_cost_curve(model, context_ids, sorted(bad)))
    again = forward_cost_curve(model, context_ids, [1])[1]
    drift = abs(again / curve[1] - 1) > DRIFT_SLACK
    curve[1] = min(curve[1], again)
    clean = not drift and not disturbed_points(curve) and others_busy(start) < BUSY_CORES
    return (curve if clean else monotone(curve)), clean


def default_sizes(max_k: int) -> list[int]:
    """Batch sizes to measure for verifications of up to max_k draft tokens."""
    sizes = set(range(1, min(max_k + 1, 9) + 1))
    sizes |= {b for b in (11, 13, 17, 21, 25, 33, 49) if b <= max_k + 1}
    sizes.add(max_k + 1)
    return sorted(sizes)


def cpu_name() -> str:
    """The CPU's model name (part of a cost curve's cache key)."""
    import platform

    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def costs_dir() -> Path:
    """$SPECDECODE_CACHE/costs: measured cost curves, one JSON file per key."""
    from specdecode.models.registry import cache_dir

    return cache_dir() / "costs"


def _cache_path(key: str) -> Path:
    return costs_dir() / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def _sizes(target, max_k: int, context_len: int) -> tuple[int, list[int]]:
    """(the context measured after, the batch sizes measured) for a target's cache size."""
    context_len = min(context_len, target.max_seq_len // 2)  # a small context: half of it
    return context_len, default_sizes(max(1, min(max_k, target.max_seq_len - context_len - 1)))


UNCLEAN_TRIES = 3  # measurements of a curve that never came out clean before it is kept


@dataclass(frozen=True)
class SavedCurve:
    """A cost curve as cached: `tries` is 0 for a clean measurement, else how many
    unclean measurements its per-size minimum was taken over."""
    verify: dict[int, float]
    draft_per_token: float
    tries: int

    @property
    def settled(self) -> bool:
        """Used as it is: clean, or measured UNCLEAN_TRIES times without coming out clean."""
        return self.tries == 0 or self.tries >= UNCLEAN_TRIES


def _read_saved(key: str, sizes: Sequence[int]) -> SavedCurve | None:
    """The cached curve for `key` if it has every size and is monotone, else None."""
    path = _cache_path(key)
    if not path.is_file():
        return None
    with contextlib.suppress(ValueError, KeyError, OSError, TypeError):
        saved = json.loads(path.read_text())
        curve = {int(b): float(c) for b, c in saved["verify"].items()}
        if saved["key"] == key and set(sizes) <= set(curve) and not disturbed_points(curve):
            return SavedCurve(curve, float(saved["draft_per_token"]), int(saved.get("tries", 0)))
    return None


def read_cached(target, *, key: str, max_k: int, context_len: int = 256) -> CostModel | None:
    """The cost curve `cached_costs` would return from its cache for these arguments,
    without measuring anything: None when none is cached (or the cached one is not
    monotone, or lacks a size `cached_costs` would measure). An unsettled curve
    (measured unclean fewer than UNCLEAN_TRIES times) is returned too: it is a prior."""
    saved = _read_saved(key, _sizes(target, max_k, context_len)[1])
    return None if saved is None else CostModel(saved.verify, saved.draft_per_token)


def _merge(curve: dict[int, float], clean: bool, before: SavedCurve | None
           ) -> tuple[dict[int, float], int]:
    """(the curve to cache, its tries): a clean measurement as it is; an unclean one
    merged with the unclean ones before it by the per-size minimum (the pass least
    disturbed), made monotone."""
    if clean:
        return curve, 0
    if before is None or before.tries == 0:
        return curve, 1
    return monotone({b: min(c, before.verify.get(b, c)) for b, c in curve.items()}), \
        before.tries + 1


def cached_costs(
    target,
    draft=None,
    *,
    key: str,
    max_k: int,
    context_len: int = 256,
    refresh: bool = False,
) -> tuple[CostModel, bool]:
    """The target's cost curve c(b), b = 1..max_k + 1 (and the draft model's
    one-token cost relative to it), measured once per `key` (model files,
    backend, threads, machine) and kept under $SPECDECODE_CACHE/costs/.

    Returns (costs, from_cache). Measuring takes seconds to minutes of forward
    passes after a `context_len`-token context; it leaves both caches empty. A
    clean measurement (`measure_curve`) is cached for good. An unclean one (a busy
    or noisy machine) is cached too, and measured again at the next loads until one
    comes out clean or UNCLEAN_TRIES were taken (their per-size minimum is kept):
    a busy machine at one load must not decide every later run, and a noisy one
    must not measure at every load. Either way the curve is only the controller's
    prior, corrected by the passes it observes (controller.py). `refresh`
    measures again and forgets what was cached.
    """
    sizes = _sizes(target, max_k, context_len)
    saved = None if refresh else _read_saved(key, sizes[1])
    if saved is not None and saved.settled:
        return CostModel(saved.verify, saved.draft_per_token), True
    context = [(i * 7919) % 1000 + 100 for i in range(sizes[0])]  # any in-vocabulary ids
    measured, clean = measure_curve(target, context, sizes[1])
    target.rollback(0)
    draft_per_token = 0.0
    if draft is not None:
        draft_per_token = forward_cost_curve(draft, context, [1])[1] / measured[1]
        draft.rollback(0)
    curve, tries = _merge(measured, clean, saved)
    path = _cache_path(key)
    with contextlib.suppress(OSError):  # a read-only cache: measured again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "verify": curve, "draft_per_token":
                                    draft_per_token, "tries": tries}, indent=1))
    return CostModel(curve, draft_per_token), False
