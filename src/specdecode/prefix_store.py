"""Earlier conversations' caches kept in memory, so one that another displaced from
the target's cache resumes without prefilling its prefix again.

The target holds one cache (engine.py reuses the longest prefix it shares with a
new request). With several users taking turns, each turn would find the other
user's conversation there and prefill its own from the start. A PrefixStore
keeps snapshots of displaced caches (the backend's `snapshot()` / `restore()`:
models/transformer.py, models/llama_cpp.py), least recently used evicted first,
within a byte budget and the memory the machine has free. Before a request's
prefill, `swap_in` puts back the stored snapshot that shares the most of the
request's tokens when it shares at least `min_tokens` more than the live cache
does, and stores the live cache in its place (like llama-server's prompt cache
in RAM). What it holds is the keys/values the target computed for those ids, so
a restored prefix decodes as the cache it was taken of (tests/test_prefix_store.py).

Privacy: as with the live cache, a request can learn from its cached-token count
and time to first token whether another request sent the same prefix (README
"Prefix reuse and suffix drafting"); `--prefix-store-mb 0` turns the store off.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specdecode import limits
from specdecode.models.base import CacheSnapshot, CausalLM

# Memory the store leaves free for everything else when it adds a snapshot.
HEADROOM_BYTES = 1 << 30


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixStore:
    """Snapshots of target caches, oldest use evicted first, at most `budget_bytes`
    in all; only snapshots of `min_tokens` or more are kept."""

    def __init__(self, budget_bytes: int, min_tokens: int = 64) -> None:
        if budget_bytes < 0 or min_tokens < 1:
            raise ValueError("budget_bytes must be >= 0 and min_tokens >= 1")
        self.budget_bytes, self.min_tokens = budget_bytes, min_tokens
        self._entries: OrderedDict[int, CacheSnapshot] = OrderedDict()  # LRU first
        self._next = 0
        self.swaps = 0
        self.restored_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """Entries, bytes and tokens held; swaps and tokens restored so far."""
        return {"entries": len(self), "bytes": self.nbytes,
                "tokens": sum(len(s.ids) for s in self._entries.values()),
                "swaps": self.swaps, "restored_tokens": self.restored_tokens}

    def swap_in(self, target: CausalLM, want: Sequence[int]) -> int:
        """Before prefilling `want` on `target`: restore the stored snapshot sharing
        the most of it when that beats the live cache by min_tokens, storing the live
        cache instead; with no such snapshot, store the live cache when the prefill
        would overwrite min_tokens or more of it. Returns the tokens of `want` the
        restored snapshot holds (0: no swap). A target without snapshot/restore is
        left alone."""
        if not self.budget_bytes or getattr(target, "restore", None) is None:
            return 0
        cached = target.cached_ids
        live = common_prefix(cached, want)
        best, shared = None, live + self.min_tokens - 1
        for key, snap in self._entries.items():
            n = common_prefix(snap.ids, want)
            if n > shared:
                best, shared = key, n
        if best is None:
            if len(cached) - live >= self.min_tokens:  # about to be overwritten: keep it
                self.put(target.snapshot())
            return 0
        snap = self._entries.pop(best)
        self.put(target.snapshot())
        target.restore(snap)
        self.swaps += 1
        self.restored_tokens += shared
        return shared

    def put(self, snap: CacheSnapshot) -> bool:
        """Keep a snapshot (False: too short, too big, or no memory to spare). An entry
        whose ids start the new one's (the same conversation, earlier) is dropped."""
        if len(snap.ids) < self.min_tokens or snap.nbytes > self.budget_bytes:
            return False
        for key in [k for k, s in self._entries.items()
                    if common_prefix(s.ids, snap.ids) == len(s.ids)]:
            del self._entries[key]
        while self._entries and self.nbytes + snap.nbytes > self.budget_bytes:
            self._entries.popitem(last=False)
        free = limits.available_bytes()
        if free is not None and snap.nbytes + HEADROOM_BYTES > free:
            return False
        self._entries[self._next] = snap
        self._next += 1
        return True

    def clear(self) -> None:
        self._entries.clear()
