"""Transparent huge pages for memory a native library allocated (llama.cpp's weights).

Decoding one token reads every weight once, about 1 GB for the default 1.5B
Q4_K_M target. With 4 KiB pages the speed of that read depends on where the
pages landed: on this project's VMs two copies of the same model in one process,
loaded before and after starting another program, decoded at 8.7-10.6 vs
11.4-12.5 tokens/s (llama-server: 10.4-12.0). Backed by 2 MiB pages both ran
at 12.9-14.1. On most distributions (THP mode "madvise") llama.cpp's buffers
get 4 KiB pages, because nothing asks for more.

`collapse_new_memory()` wraps the calls that allocate: it notes the process's
private anonymous mappings before, and afterwards asks the kernel to back what
is new with huge pages, now (madvise MADV_HUGEPAGE, then MADV_COLLAPSE, Linux
6.1+). Best effort: on another OS, an older kernel or THP "never" it does
nothing, and its result says how much it backed. Memory mapped from a file
(llama.cpp's default way of loading) cannot be collapsed: the llama.cpp
backend reads the file instead. A program started with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 gets huge pages from malloc directly
(llama-server too); then there is nothing left to collapse.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20  # bytes in an x86-64 / arm64 (4 KiB base page) huge page


def anonymous_regions() -> list[tuple[int, int]]:
    """[start, end) of this process's private, writable, anonymous mappings
    (the heap included); empty where /proc/self/maps does not exist."""
    regions = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                span, perms, inode = fields[0], fields[1], fields[4]
                path = fields[5] if len(fields) > 5 else ""
                if perms.startswith("rw") and perms.endswith("p") and inode == "0" and \
                        path in ("", "[heap]"):
                    lo, hi = span.split("-")
                    regions.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return regions


def new_spans(before: list[tuple[int, int]],
              after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `after`'s intervals that no interval of `before` covers
    (a new allocation can merge with a neighbouring old mapping)."""
    old = sorted(before)
    out = []
    for lo, hi in sorted(after):
        cur = lo
        for a, b in old:
            if b <= cur or a >= hi:
                continue
            if a > cur:
                out.append((cur, a))
            cur = max(cur, b)
        if cur < hi:
            out.append((cur, hi))
    return out


def collapse(spans: list[tuple[int, int]]) -> int:
    """Back the 2 MiB-aligned parts of `spans` with huge pages; returns the bytes
    collapsed (0 where the kernel or the OS cannot)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in spans:
        lo, hi = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        if hi - lo < HUGE:
            continue
        libc.madvise(lo, hi - lo, MADV_HUGEPAGE)  # later faults, khugepaged: huge pages too
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done += hi - lo
    return done


@contextlib.contextmanager
def collapse_new_memory(enabled: bool = True) -> Iterator[list[int]]:
    """Run the block, then back the anonymous memory it mapped with huge pages.
    Yields a one-element list that holds the bytes collapsed afterwards."""
    result = [0]
    before = anonymous_regions() if enabled else []
    yield result
    if enabled:
        result[0] = collapse(new_spans(before, anonymous_regions()))
