"""A training run's memory: freed heap memory goes back to the system (train/heap.py);
shards that cannot fit are refused before they are loaded (train/run.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode import limits
from specdecode.train.run import RunOptions, check_memory

# In a fresh process (a long test session's heap is already fragmented in ways no
# test controls): tensors of a few MB freed under small live ones stay resident
# in glibc's heap, what grew a training run by GBs (train/heap.py).
SCENARIO = """
import json, torch
from pathlib import Path
from specdecode.train.heap import release_freed
def anon_mb():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("RssAnon"))
    return int(line.split()[1]) / 1024
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # glibc's mmap threshold rises
big, pins = [], []
for _ in range(48):
    big.append(torch.empty(4 << 20, dtype=torch.uint8).fill_(1))
    pins.append(torch.empty(256 << 10, dtype=torch.uint8))  # the heap's top stays in use
big.clear()
before = anon_mb()
released = release_freed()
print(json.dumps({"before": before, "after": anon_mb(), "released": released}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self/status").exists(),
                    reason="glibc's malloc_trim and /proc are Linux's")
def test_freed_tensors_kept_by_the_heap_go_back_to_the_system() -> None:
    out = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                         check=True, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["released"]
    assert r["before"] - r["after"] > 100, r  # of the 192 MB freed


def test_shards_that_cannot_fit_are_refused_before_loading(tmp_path, monkeypatch) -> None:
    """Shards of 300 MB and a head's training state against 1 GB available: a
    clear error naming what lowers it; against 8 GB: nothing."""
    shard = tmp_path / "000000.safetensors"
    shard.write_bytes(b"0" * (300 << 20))
    options = RunOptions(drafter="eagle3", draft_vocab=8192, head_intermediate=3072)
    monkeypatch.setattr(limits, "available_bytes", lambda: 1 << 30)
    with pytest.raises(ValueError, match=r"training needs about 2\.\d GB .*fewer --prompts"):
        check_memory([shard], 1536, options)
    monkeypatch.setattr(limits, "available_bytes", lambda: 8 << 30)
    check_memory([shard], 1536, options)


def test_the_guard_releases_only_after_the_process_grew_by_its_slack(monkeypatch) -> None:
    from specdecode.train import heap

    levels = iter([1000, 1500, 2100, 1200, 2000])  # each RssAnon read, in order
    released = []
    monkeypatch.setattr(heap, "anon_resident_bytes", lambda: next(levels))
    monkeypatch.setattr(heap, "release_freed", lambda: released.append(1) or True)
    guard = heap.HeapGuard(slack=1000)
    # level 1000; 1500: no; 2100 (+1100): release, level 1200 after; 2000 (+800): no
    assert [guard.after_step() for _ in range(4)] == [False, False, True, False]
    assert guard.level == 1200 and len(released) == 1
