"""Handing freed heap memory back to the system while training.

A training step allocates tensors of a new shape each time (packed windows of
varying length: train/eagle_fit.py), and glibc's malloc keeps what they free
in its arenas instead of returning it. On the default target that grew a
training process by ~300 MB a step at first, until the kernel killed it at
24 GB after ~2,700 steps (a run of v8's command). glibc's malloc_trim after
every step held a loop over the same data ~2.1 GB above the data and the
target (the optimiser's state, kernels' caches) against +4.8 GB and rising
after 40 steps without, but a whole run trimmed every step used 23.6 minutes
of kernel CPU time in 89.5 (the killed run, untrimmed: 8.4 in 85) and took
2.17 s a step against ~1.5 s (pages handed back and faulted in again). HeapGuard trims
only when the process has grown by `slack` since the last trim: over the first
40 steps of that loop (the fast-growing ones) it trimmed 10 times, held the
same +2.2 GB, and took 71-81 s against 82-86 s trimming every step (two
rounds each, alternating). Over a whole run it was not measured yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

from specdecode.memory import anon_resident_bytes


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed() -> bool:
    """Return the heap's free pages to the system (glibc's malloc_trim(0)); False
    where the C library has no such call (then nothing is done)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapGuard:
    """`after_step()` after each training step: release_freed() when the anonymous
    resident memory has grown more than `slack` bytes above its level after the
    last release (the first call sets the level); without RssAnon, every call
    releases."""

    def __init__(self, slack: int = 1 << 30) -> None:
        self.slack, self.level, self.releases = slack, None, 0

    def after_step(self) -> bool:
        """Whether this call released."""
        now = anon_resident_bytes()
        if now and self.level is None:
            self.level = now
            return False
        if now and now - self.level <= self.slack:
            return False
        released = release_freed()
        self.level, self.releases = anon_resident_bytes(), self.releases + released
        return released
