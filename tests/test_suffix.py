"""The suffix drafter's rules (longest match, most frequent continuation, the share
cut-off, the length limit) and its store of earlier requests (bounded, evicting the
oldest). Exactness: tests/test_greedy_lossless.py and tests/test_distribution.py."""

from __future__ import annotations

import pytest
import torch

from conftest import plain_greedy
from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.drafters import SuffixDrafter, SuffixStore
from specdecode.drafters.base import DraftContext
from specdecode.drafters.suffix import STORE_MIN_MATCH, STORE_N


def propose(drafter: SuffixDrafter, context: list[int], k: int) -> list[int]:
    drafter.begin(context, SamplingParams(), torch.Generator())
    return drafter.propose(DraftContext(context, k)).tokens.tolist()


def test_the_most_frequent_continuation_wins_over_the_most_recent():
    # after [0, 1, 2]: 3 4 (twice), then 3 9 (the most recent)
    ctx = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 9, 0, 1, 2]
    d = SuffixDrafter(min_token_prob=0.0)
    assert propose(d, ctx, 3) == [3, 4, 0]
    assert d.match_n == 3  # [0, 1, 2], extended backwards


def test_the_longest_match_decides_which_occurrences_count():
    # [7, 1, 2] occurred once (followed by 5); [1, 2] more often (followed by 3)
    ctx = [1, 2, 3, 8, 1, 2, 3, 8, 7, 1, 2, 5, 8, 7, 1, 2]
    assert propose(SuffixDrafter(), ctx, 2) == [5, 8]


def test_a_continuation_below_min_token_prob_ends_the_draft():
    # after [0, 5, 6]: 1, 2, 3, 4 each once -> 25 % each
    ctx = [0, 5, 6, 1, 0, 5, 6, 2, 0, 5, 6, 3, 0, 5, 6, 4, 0, 5, 6]
    assert propose(SuffixDrafter(min_token_prob=0.3), ctx, 4) == []
    assert len(propose(SuffixDrafter(min_token_prob=0.2), ctx, 4)) >= 1


def test_draft_length_is_limited_by_the_match_length():
    text = list(range(100, 140))
    ctx = text + [1] + text[:2]  # a 2-token match of a long text
    assert len(propose(SuffixDrafter(max_spec_factor=2.0), ctx, 30)) == 4
    assert len(propose(SuffixDrafter(max_spec_factor=100.0), ctx, 30)) == 30


def test_no_match_and_no_room():
    assert propose(SuffixDrafter(), [1, 2, 3, 4], 4) == []
    assert propose(SuffixDrafter(), [5], 4) == []
    assert propose(SuffixDrafter(), [1, 2, 1, 2], 0) == []


def test_bad_config():
    with pytest.raises(ValueError):
        SuffixDrafter(max_n=1, min_n=2)
    with pytest.raises(ValueError):
        SuffixDrafter(min_token_prob=1.5)
    with pytest.raises(ValueError):
        SuffixStore(max_tokens=-1)


def test_store_drafts_an_earlier_requests_text():
    store = SuffixStore()
    d = SuffixDrafter(store)
    earlier = list(range(50, 90))
    d.begin(earlier[:10], SamplingParams(), torch.Generator())
    d.finish(earlier[10:])  # the request's prompt + output go to the store
    assert store.stats()["texts"] == 1 and store.stats()["tokens"] == 40
    ctx = [1, 2, 3] + earlier[5:5 + STORE_MIN_MATCH]
    assert propose(d, ctx, 8) == earlier[5 + STORE_MIN_MATCH:5 + STORE_MIN_MATCH + 8]
    short = [1, 2, 3] + earlier[5:5 + STORE_MIN_MATCH - 1]  # too short a match to trust
    assert propose(d, short, 8) == []


def test_store_is_bounded_and_evicts_the_oldest():
    store = SuffixStore(max_tokens=100)
    texts = [list(range(1000 * i, 1000 * i + 40)) for i in range(4)]
    for t in texts:
        store.add(t)
    s = store.stats()
    assert s["tokens"] <= 100 and s["texts"] == 2 and s["evicted"] == 2 and s["bytes"] > 0
    assert store.occurrences(tuple(texts[0][:STORE_N])) == []  # evicted, also from the index
    assert store.occurrences(tuple(texts[3][:STORE_N])) != []
    store.add([1, 2])  # too short to index: ignored
    assert store.stats()["texts"] == 2


def test_a_conversations_next_turn_replaces_its_last_turn_in_the_store():
    store = SuffixStore()
    turn1 = list(range(10, 30))
    store.add(turn1)
    store.add(turn1 + [7, 8, 9, 10, 11])  # the next turn resends turn 1
    assert store.stats()["texts"] == 1 and store.stats()["tokens"] == 25
    assert len(store.occurrences(tuple(turn1[:STORE_N]))) == 1  # counted once
    store.add(list(range(500, 520)))  # another conversation: kept beside it
    assert store.stats()["texts"] == 2
    store.clear()
    assert store.stats() == {"texts": 0, "tokens": 0, "evicted": 0, "bytes": 0}
    assert store.occurrences(tuple(turn1[:STORE_N])) == []


def test_a_repeated_request_is_drafted_from_the_store(target):
    """The second time a prompt comes, the first answer (in the store) is the draft:
    nearly every token accepted, and the output the same."""
    prompt = [3, 141, 59, 26, 53, 58, 97, 11, 250, 8, 77, 3, 61, 19, 205, 44, 9, 120, 33, 70]
    plain = plain_greedy(target, prompt, 40)
    decoder = SpeculativeDecoder(target, SuffixDrafter(SuffixStore()), 16)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = decoder.generate(prompt, params)
    again = decoder.generate(prompt, params)
    assert first.token_ids == again.token_ids == plain
    assert again.stats.acceptance_rate > 0.9 and again.stats.steps <= 6


def test_llm_loads_the_suffix_drafter_by_name():
    """LLM.load(drafter="suffix"): one store per load, filled by each request; a repeated
    chat turn is drafted from it (and its prompt comes from the prefix cache)."""
    import real
    from specdecode.llm import LLM

    llm = LLM.load(str(real.path("smollm2-135m")), drafter="suffix", dtype="float32",
                   backend="torch", adaptive=False)
    ids = llm.encode("Name three colours.", chat=True)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first, again = llm.generate(ids, params), llm.generate(ids, params)
    assert again.text == first.text
    [drafter] = llm.decoder.drafters
    assert isinstance(drafter, SuffixDrafter)
    # the same text twice is kept once (a repeat extends, trivially, the last text)
    assert drafter.store.stats()["texts"] == 1
    assert drafter.store.stats()["tokens"] == len(ids) + 24
    assert again.stats.acceptance_rate > 0.9 and again.stats.cached_tokens > 0
