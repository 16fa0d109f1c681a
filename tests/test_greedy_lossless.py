"""Greedy speculative output == plain greedy output, token for token (float32)."""

from __future__ import annotations

import pytest

from conftest import OracleDrafter, plain_greedy, tiny
from specdecode import DraftModelDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from specdecode.drafters import SuffixDrafter, SuffixStore

KS = [1, 2, 3, 5, 8]
PROMPTS = {
    "len1": [17],
    "len7": [3, 141, 59, 26, 53, 58, 97],
    # Repetitive prompt so the n-gram drafter finds matches.
    "len40": [11, 12, 13, 14, 15, 16, 17, 18] * 5,
}
MAX_TOKENS = 29  # not a multiple of any k + 1 used: the last step ends mid-draft


def make_drafter(kind: str, target, truth: list[int]):
    if kind == "other-model":
        return DraftModelDrafter(tiny(seed=2), target)
    if kind == "self":
        return DraftModelDrafter(tiny(seed=1), target)  # same weights, own cache
    if kind == "ngram":
        return NgramDrafter(max_n=3, min_n=1)
    if kind == "always-wrong":
        return OracleDrafter(truth, target.vocab_size)
    if kind == "suffix":
        return SuffixDrafter()  # this request's text only
    if kind == "suffix-store":  # an earlier request's text: its own greedy output, half
        store = SuffixStore()   # of it perturbed, so drafts are both kept and rejected
        store.add([t if i % 7 else (t + 1) % target.vocab_size for i, t in enumerate(truth)])
        return SuffixDrafter(store)
    raise AssertionError(kind)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("kind", ["other-model", "self", "ngram", "always-wrong", "suffix",
                                  "suffix-store"])
@pytest.mark.parametrize("k", KS)
def test_greedy_identical_to_plain(target, prompt_name, kind, k):
    prompt = PROMPTS[prompt_name]
    plain = plain_greedy(target, prompt, MAX_TOKENS)
    assert len(plain) == MAX_TOKENS
    drafter = make_drafter(kind, target, prompt + plain)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    result = SpeculativeDecoder(target, drafter, k).generate(prompt, params)

    assert result.token_ids == plain
    assert result.finish_reason == "length"
    stats = result.stats
    assert stats.emitted == MAX_TOKENS
    if kind == "self":
        assert stats.acceptance_rate == 1.0
        assert stats.drafted > 0
    if kind == "suffix-store":
        assert 0 < stats.accepted < stats.drafted
    if kind == "always-wrong":
        assert stats.acceptance_rate == 0.0
        assert stats.steps == MAX_TOKENS  # one recovered token per step
        assert stats.drafted > 0


def test_ngram_accepts_on_repetitive_text(target):
    """Sanity check that the n-gram runs above exercise acceptance, not only rejection."""
    prompt = PROMPTS["len40"]
    plain = plain_greedy(target, prompt, 60)
    # Feed the model's own continuation back: the second time round lookup hits.
    prompt2 = prompt + plain + prompt
    result = SpeculativeDecoder(target, NgramDrafter(), 4).generate(
        prompt2, SamplingParams(max_tokens=40, ignore_eos=True))
    assert result.token_ids == plain_greedy(target, prompt2, 40)
    assert result.stats.accepted > 0


def test_plain_paths_agree(target):
    """k = 0 with a drafter is plain decoding too: one token per step, nothing drafted."""
    prompt = PROMPTS["len7"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = SpeculativeDecoder(target, None).generate(prompt, params)
    b = SpeculativeDecoder(target, NgramDrafter(), k=0).generate(prompt, params)
    assert a.token_ids == b.token_ids
    assert b.stats.drafted == 0 and b.stats.steps == 12 and b.stats.mean_accepted_length == 1.0


def test_qwen2_shape_lossless():
    """Qwen2 features (qkv bias, tied embeddings, 1 kv head) decode losslessly too."""
    target = tiny(seed=5, preset="tiny-qwen2")
    prompt = PROMPTS["len7"]
    plain = plain_greedy(target, prompt, 20)
    drafter = DraftModelDrafter(tiny(seed=5, preset="tiny-qwen2"), target)
    result = SpeculativeDecoder(target, drafter, 3).generate(
        prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert result.token_ids == plain
    assert result.stats.acceptance_rate == 1.0
