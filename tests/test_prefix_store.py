"""The prefix store: users taking turns each resume their own conversation's cache.

A snapshot restored into the target's cache holds the same keys/values, so what is
decoded after it equals what the cache it was taken of decodes (float32 torch here;
llama.cpp: test_llama_cpp.py). Two conversations interleaved on one decoder reuse
their whole earlier turns with the store, and only their shared start without it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny
from specdecode import NgramDrafter, SamplingParams, SpeculativeDecoder
from specdecode.models.base import CacheSnapshot
from specdecode.prefix_store import PrefixStore, common_prefix

A = [5, 9, 200, 31, 7, 77, 3, 42, 11, 19] * 2
B = [5, 9, 200, 31, 8, 14, 150, 60, 2, 90] * 2  # shares A's first 4 tokens
MORE = [17, 4, 250, 9]


def check_snapshot_restores_the_cache(model) -> None:
    """After restore, the next pass's logits equal those of the cache snapshotted."""
    model.prefill(torch.tensor(A))
    snap = model.snapshot()
    assert snap.ids == A and snap.nbytes > 0
    before = model.forward(torch.tensor(MORE)).logits
    model.prefill(torch.tensor(B))  # another conversation overwrites it
    model.restore(snap)
    assert model.cached_ids == A and model.cached_len == len(A)
    assert torch.equal(model.forward(torch.tensor(MORE)).logits, before)


def test_snapshot_restores_the_cache_torch():
    check_snapshot_restores_the_cache(tiny(2))


def check_users_taking_turns(target, k: int = 4, store_mb: int = 64) -> list:
    """A1, B1, A2, B2 on one decoder (each turn 2 = turn 1 + its answer + MORE):
    returns each turn's (output ids, cached_tokens)."""
    target.rollback(0)  # nothing cached from before
    store = PrefixStore(store_mb << 20, min_tokens=8) if store_mb else None
    decoder = SpeculativeDecoder(target, NgramDrafter(), k, prefix_store=store)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out, prompts = [], {"A": list(A), "B": list(B)}
    for user in ("A", "B", "A", "B"):
        r = decoder.generate(prompts[user], params)
        out.append((r.token_ids, r.stats.cached_tokens))
        prompts[user] = prompts[user] + r.token_ids + MORE
    return out


@pytest.mark.parametrize("k", [0, 4])
def test_users_taking_turns_resume_their_own_cache(k):
    """With the store each user's turn 2 reuses its turn 1 (prompt + answer but the
    pending token); without it only the 4 tokens both users start with. The tokens
    are those of fresh prefills (prefix cache off)."""
    stored = check_users_taking_turns(tiny(3), k)
    plain = check_users_taking_turns(tiny(3), k, store_mb=0)
    fresh = [SpeculativeDecoder(tiny(3), NgramDrafter(), k, prefix_cache=False)]
    assert [ids for ids, _ in stored] == [ids for ids, _ in plain]
    whole = len(A) + 12 - 1
    assert [c for _, c in stored] == [0, 4, whole, whole]
    assert [c for _, c in plain] == [0, 4, 4, 4]  # the negative control
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    turn2 = A + stored[0][0] + MORE
    assert fresh[0].generate(turn2, params).token_ids == stored[2][0]


def snap(ids: list[int], nbytes: int = 100) -> CacheSnapshot:
    return CacheSnapshot(ids, None, nbytes)


def test_store_bounds_its_bytes_and_evicts_the_oldest_use_first():
    store = PrefixStore(300, min_tokens=2)
    assert store.put(snap([1, 2, 3])) and store.put(snap([4, 5, 6]))
    assert store.put(snap([7, 8, 9]))
    assert store.put(snap([10, 11, 12]))  # over 300 bytes: [1, 2, 3] goes
    assert [s.ids[0] for s in store._entries.values()] == [4, 7, 10]
    assert store.stats()["bytes"] == 300 and store.stats()["tokens"] == 9
    assert not store.put(snap([1, 2], nbytes=301))  # bigger than the budget
    assert not store.put(snap([1]))  # shorter than min_tokens
    assert store.put(snap([4, 5, 6, 1, 2]))  # the same conversation, later: replaces
    assert len(store) == 3 and [4, 5, 6] not in [s.ids for s in store._entries.values()]
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def test_swap_needs_min_tokens_more_than_the_live_cache():
    """A snapshot sharing fewer than min_tokens more than the live cache stays stored;
    a live cache the prefill would overwrite by min_tokens or more is stored."""
    model = tiny(2)
    store = PrefixStore(64 << 20, min_tokens=8)
    model.prefill(torch.tensor(A))
    assert store.swap_in(model, B) == 0 and len(store) == 1  # A would be overwritten
    model.prefill(torch.tensor(B))
    assert store.swap_in(model, B[:6]) == 0  # B's own prefix: nothing to swap
    assert store.swap_in(model, A[:11]) == 0  # 7 more than the live 4: not worth a swap
    assert store.swap_in(model, A[:12]) == 12 and model.cached_ids == A  # 8 more
    assert [s.ids for s in store._entries.values()] == [B]  # the live one stored in turn
    assert store.stats()["swaps"] == 1 and store.stats()["restored_tokens"] == 12
    assert common_prefix(A, B) == 4
    with pytest.raises(ValueError):
        PrefixStore(-1)
