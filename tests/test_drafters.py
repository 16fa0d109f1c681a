"""Drafter units: n-gram lookup rules and the draft model's vocabulary check."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny
from specdecode import DraftModelDrafter, NgramDrafter, SamplingParams
from specdecode.drafters import VocabularyMismatch
from specdecode.drafters.base import DraftContext


def propose(drafter, context, k):
    return drafter.propose(DraftContext(context, k)).tokens.tolist()


def start(drafter, prompt):
    drafter.begin(prompt, SamplingParams(), torch.Generator())


def test_ngram_prefers_the_longest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    ctx = [1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 1, 2, 3]
    start(d, ctx)
    # suffix [1, 2, 3] occurred at the start, followed by 9, 9, 7
    assert propose(d, ctx, 3) == [9, 9, 7]


def test_ngram_falls_back_to_shorter_and_most_recent():
    d = NgramDrafter(max_n=3, min_n=1)
    ctx = [4, 8, 1, 4, 9, 2, 7, 4]
    start(d, ctx)
    # no 3- or 2-gram match; the unigram 4 last occurred at index 3, then 9, 2
    assert propose(d, ctx, 2) == [9, 2]


def test_ngram_min_n_and_no_match():
    d = NgramDrafter(max_n=3, min_n=2)
    ctx = [4, 8, 1, 4]
    start(d, ctx)
    assert propose(d, ctx, 4) == []
    assert propose(NgramDrafter(), [5], 4) == []


def test_ngram_proposal_is_cut_at_the_end_of_text():
    d = NgramDrafter(max_n=2, min_n=1)
    ctx = [1, 2, 3, 1, 2]
    start(d, ctx)
    assert propose(d, ctx, 5) == [3, 1, 2]


def test_ngram_grows_incrementally_and_rebuilds_for_a_new_context():
    d = NgramDrafter(max_n=2, min_n=1)
    start(d, [1, 2, 3])
    assert propose(d, [1, 2, 3], 2) == []
    assert propose(d, [1, 2, 3, 1], 2) == [2, 3]
    assert propose(d, [7, 7, 8, 7], 2) == [8, 7]  # not an extension: rebuilt


def test_ngram_bad_config():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(max_n=1, min_n=2)


def test_draft_model_vocabulary_mismatch_is_a_clear_error():
    target = tiny(1)
    small = tiny(2, "tiny").__class__.random(
        tiny(1).config.with_(vocab_size=200), seed=2)
    with pytest.raises(VocabularyMismatch, match=r"\(200 tokens\) differs from the target's"):
        DraftModelDrafter(small, target)
    # Padding only: allowed when the caller states the shared vocabulary.
    drafter = DraftModelDrafter(small, target, shared_vocab_size=200)
    params, generator = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
    drafter.begin([1, 2], params, generator)
    draft = drafter.propose(DraftContext([1, 2, 3], 3, params, generator))
    assert draft.q.shape == (3, 256) and float(draft.q[:, 200:].sum()) == 0.0
    assert all(t < 200 for t in draft.tokens.tolist())
    with pytest.raises(VocabularyMismatch, match="does not fit"):
        DraftModelDrafter(small, target, shared_vocab_size=256)


def test_draft_model_respects_its_context_limit():
    target = tiny(1)
    drafter = DraftModelDrafter(tiny(1, max_seq_len=8), target)
    start(drafter, [1])
    assert len(drafter.propose(DraftContext(list(range(1, 7)), 5))) == 3  # 6 + 3 - 1 = 8 fits
    assert len(drafter.propose(DraftContext(list(range(1, 10)), 5))) == 0
