"""Measured step costs: how long one forward pass over b new tokens takes.

The cost curve c(b) of the target decides what a verification of k draft
tokens (b = k + 1) costs relative to one plain step (b = 1); on a CPU it is
far from flat (memory-bound at b = 1, compute-bound as b grows).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdecode.cachefile import read_keyed, write_keyed
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
    processes kept less than BUSY_CORES busy meanwhile (only a clean curve is
    cached for good: cached_costs); an unclean one is returned made monotone."""
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


def _sizes(target, max_k: int, context_len: int) -> tuple[int, list[int]]:
    """(the context measured after, the batch sizes measured) for a target's cache size."""
    context_len = min(context_len, target.max_seq_len // 2)  # a small context: half of it
    return context_len, default_sizes(max(1, min(max_k, target.max_seq_len - context_len - 1)))


UNCLEAN_TRIES = 3  # unclean measurements of a curve, TRY_SPACING apart, before it is kept
TRY_SPACING = 600.0  # seconds between two measurements that count as separate tries
UNCLEAN_KEEP = 7 * 86400.0  # seconds a kept unclean curve is used before it is measured again


@dataclass(frozen=True)
class SavedCurve:
    """A cost curve as cached (seconds): `tries` is 0 for a clean measurement, else
    how many unclean ones (TRY_SPACING apart) its per-size minimum was taken over;
    `at`: when the last of them counted (time.time())."""
    verify: dict[int, float]
    draft_per_token: float
    tries: int = 0
    at: float = 0.0

    def settled(self, now: float) -> bool:
        """Used as it is: clean, or kept after UNCLEAN_TRIES unclean tries and not
        older than UNCLEAN_KEEP."""
        return self.tries == 0 or (self.tries >= UNCLEAN_TRIES and now - self.at < UNCLEAN_KEEP)

    def fields(self) -> dict:
        """What is saved besides the key."""
        return {"verify": self.verify, "draft_per_token": self.draft_per_token,
                "tries": self.tries, "at": self.at}


def _read_saved(key: str, sizes: Sequence[int]) -> SavedCurve | None:
    """The cached curve for `key` if it has every size and is monotone, else None (a
    file written before `tries` existed held only clean curves)."""
    saved = read_keyed(costs_dir(), key)
    if saved is None:
        return None
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        curve = {int(b): float(c) for b, c in saved["verify"].items()}
        if set(sizes) <= set(curve) and not disturbed_points(curve):
            return SavedCurve(curve, float(saved["draft_per_token"]), int(saved.get("tries", 0)),
                              float(saved.get("at", 0.0)))
    return None


def read_cached(target, *, key: str, max_k: int, context_len: int = 256) -> CostModel | None:
    """The cost curve `cached_costs` would return from its cache for these arguments,
    without measuring anything: None when none is settled there (none cached, an
    unclean one still to be measured again, not monotone, or lacking a size
    `cached_costs` would measure)."""
    saved = _read_saved(key, _sizes(target, max_k, context_len)[1])
    if saved is None or not saved.settled(time.time()):
        return None
    return CostModel(saved.verify, saved.draft_per_token)


def _merge(measured: SavedCurve, before: SavedCurve | None, now: float) -> SavedCurve:
    """What to cache after a measurement (`measured.tries`: 0 if clean, else 1): a
    clean one as it is; an unclean one merged with the unclean tries before it
    (not with an expired kept curve: that starts over) by the per-size minimum
    (the pass least disturbed), the draft's seconds per token too; it counts as a
    new try only TRY_SPACING after the last, so one busy spell is one try."""
    if measured.tries == 0 or before is None or not 0 < before.tries < UNCLEAN_TRIES:
        return replace(measured, at=now)
    verify = {b: min(c, before.verify.get(b, c)) for b, c in measured.verify.items()}
    draft = min(measured.draft_per_token * measured.verify[1],
                before.draft_per_token * before.verify[1]) / verify[1]
    spaced = now - before.at >= TRY_SPACING
    return SavedCurve(verify, draft, before.tries + spaced, now if spaced else before.at)


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
    passes after a `context_len`-token context; it leaves both models' KV caches
    empty. A clean measurement (`measure_curve`) is cached for good. An unclean one
    (a busy or noisy machine) is cached too, and measured again at the next loads
    until one comes out clean or UNCLEAN_TRIES tries, TRY_SPACING apart, have not
    (their per-size minimum is then kept for UNCLEAN_KEEP): a busy spell at load
    time must not decide every later run, and a noisy machine must not measure at
    every load. Either way the curve is only the controller's prior, corrected by
    the passes it observes (controller.py). `refresh` measures again and forgets
    what was cached.
    """
    sizes, now = _sizes(target, max_k, context_len), time.time()
    saved = None if refresh else _read_saved(key, sizes[1])
    if saved is not None and saved.settled(now):
        return CostModel(saved.verify, saved.draft_per_token), True
    context = [(i * 7919) % 1000 + 100 for i in range(sizes[0])]  # any in-vocabulary ids
    curve, clean = measure_curve(target, context, sizes[1])
    target.rollback(0)
    draft_per_token = 0.0
    if draft is not None:
        draft_per_token = forward_cost_curve(draft, context, [1])[1] / curve[1]
        draft.rollback(0)
    kept = _merge(SavedCurve(curve, draft_per_token, 0 if clean else 1), saved, now)
    write_keyed(costs_dir(), key, kept.fields())  # read-only: measured again next time
    return CostModel(kept.verify, kept.draft_per_token), False
