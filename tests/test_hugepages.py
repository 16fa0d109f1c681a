"""hugepages.py: which memory is new, and backing it with 2 MiB pages."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest

from specdecode.models import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_new_spans_are_the_parts_no_old_mapping_covers():
    before = [(0, 10), (20, 30), (50, 60)]
    after = [(0, 15), (18, 35), (50, 60), (70, 80)]  # grown, merged, same, new
    assert hugepages.new_spans(before, after) == [(10, 15), (18, 20), (30, 35), (70, 80)]
    assert hugepages.new_spans([], [(5, 9)]) == [(5, 9)]
    assert hugepages.new_spans([(0, 100)], [(10, 20)]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_collapse_backs_new_anonymous_memory_with_huge_pages():
    with hugepages.collapse_new_memory() as done:
        region = mmap.mmap(-1, 8 * hugepages.HUGE,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.write(b"\1" * len(region))  # touched, as loaded weights are
    assert region[:4] == b"\1\1\1\1"
    if done[0] == 0:  # best effort: with memory fragmented the kernel may have none now
        region.close()
        pytest.skip("the kernel gave no huge pages (MADV_COLLAPSE refused)")
    assert done[0] >= 6 * hugepages.HUGE  # all the 2 MiB-aligned part of it
    assert region[:4] == b"\1\1\1\1"  # contents kept
    with hugepages.collapse_new_memory(enabled=False) as off:
        other = mmap.mmap(-1, 4 * hugepages.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        other.write(b"\2" * len(other))
    assert off[0] == 0
    region.close()
    other.close()
