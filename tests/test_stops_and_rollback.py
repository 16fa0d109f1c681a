"""Stops inside drafts, the context limit, and cache rollback through the engine."""

from __future__ import annotations

import pytest
import torch

from conftest import OracleDrafter, plain_greedy, tiny
from specdecode import DraftModelDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder

PROMPT = [3, 141, 59, 26, 53]


def self_drafter(target):
    return DraftModelDrafter(tiny(seed=1), target)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 10, 11])
def test_max_tokens_inside_an_accepted_draft(target, max_tokens):
    result = SpeculativeDecoder(target, self_drafter(target), k=8).generate(
        PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert result.token_ids == plain_greedy(target, PROMPT, max_tokens)
    assert len(result.token_ids) == max_tokens
    assert result.finish_reason == "length"
    assert result.stats.emitted == max_tokens


@pytest.mark.parametrize("k", [1, 3, 8])
def test_eos_inside_a_draft_stops_there(target, k):
    plain = plain_greedy(target, PROMPT, 40)
    eos_at = 13
    eos = plain[eos_at]
    cut = plain[: plain.index(eos) + 1]
    decoder = SpeculativeDecoder(target, self_drafter(target), k, eos_token_ids=[eos])
    result = decoder.generate(PROMPT, SamplingParams(max_tokens=40))
    assert result.token_ids == cut
    assert result.finish_reason == "stop"
    assert result.stats.emitted == len(cut)
    assert result.stats.accepted <= len(cut)
    # Plain decoding with the same EOS agrees, stop code shared.
    plain_eos = SpeculativeDecoder(target, None, eos_token_ids=[eos]).generate(
        PROMPT, SamplingParams(max_tokens=40))
    assert plain_eos.token_ids == cut and plain_eos.finish_reason == "stop"


def test_stop_token_ids_and_ignore_eos(target):
    plain = plain_greedy(target, PROMPT, 30)
    stop = plain[7]
    params = SamplingParams(max_tokens=30, stop_token_ids=(stop,))
    decoder = SpeculativeDecoder(target, self_drafter(target), 4, eos_token_ids=[])
    result = decoder.generate(PROMPT, params)
    assert result.token_ids == plain[: plain.index(stop) + 1]
    decoder = SpeculativeDecoder(target, self_drafter(target), 4, eos_token_ids=[stop])
    result = decoder.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    assert result.token_ids == plain and result.finish_reason == "length"


def test_stop_hook_cuts_inside_an_accepted_draft(target):
    """A multi-token stop sequence (what a stop string becomes) ends the output exactly."""
    plain = plain_greedy(target, PROMPT, 30)
    pair = plain[9:11]
    end = next(i + 1 for i in range(1, len(plain)) if plain[i - 1 : i + 1] == pair)

    def hook(output: list[int]) -> bool:
        return output[-2:] == pair

    want = SpeculativeDecoder(target, None).generate(
        PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), stop_hook=hook)
    got = SpeculativeDecoder(target, self_drafter(target), 8).generate(
        PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), stop_hook=hook)
    assert got.token_ids == want.token_ids == plain[:end]
    assert got.finish_reason == want.finish_reason == "stop"
    assert got.stats.accepted < got.stats.drafted  # the draft ran past the stop
    assert got.stats.emitted == end


@pytest.mark.parametrize("drafter_kind", ["none", "self", "ngram"])
def test_context_limit(drafter_kind):
    target = tiny(1, max_seq_len=24)
    prompt = list(range(10, 30))  # 20 tokens, room for 4 more
    drafter = {"none": None, "self": DraftModelDrafter(tiny(1), target),
               "ngram": NgramDrafter()}[drafter_kind]
    result = SpeculativeDecoder(target, drafter, 8).generate(
        prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    assert result.token_ids == plain_greedy(tiny(1, max_seq_len=100), prompt, 4)
    assert result.finish_reason == "length"


def test_prompt_errors(target):
    decoder = SpeculativeDecoder(target, None)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([1, 999])
    with pytest.raises(ValueError, match="leaves no room"):
        decoder.generate([1] * target.max_seq_len)
    with pytest.raises(ValueError, match="k .* must be an integer >= 0"):
        SpeculativeDecoder(target, None, k=-1)


class CheckedDraftModelDrafter(DraftModelDrafter):
    """Checks, at every proposal, that the draft cache equals the accepted prefix
    (plus the draft's own tokens) and gives the logits of a fresh recomputation."""

    checks = 0

    def propose(self, ctx):
        context = ctx.tokens
        draft = super().propose(ctx)
        model = self.model
        assert model.cached_len == len(self._cached)
        assert self._cached == context + draft.tokens.tolist()[: max(len(draft) - 1, 0)]
        last = self._cached[-1]
        model.rollback(model.cached_len - 1)
        cached = model.forward(torch.tensor([last])).logits[-1]
        fresh = tiny(self.seed).prefill(torch.tensor(self._cached)).logits[-1]
        torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
        CheckedDraftModelDrafter.checks += 1
        return draft


def test_rollback_after_rejections_equals_recompute(target):
    """After each step (rejections included) the target cache holds exactly the
    accepted prefix and yields the same logits as recomputing it from scratch."""
    drafter = CheckedDraftModelDrafter(tiny(seed=2), target)
    drafter.seed = 2
    decoder = SpeculativeDecoder(target, drafter, k=3)
    fresh_target = tiny(seed=1)
    context, rejections = list(PROMPT), 0
    for event in decoder.stream(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True)):
        context += event.token_ids
        rejections += event.stats.accepted_per_step[-1] < event.stats.drafted_per_step[-1]
        if event.finish_reason:
            break
        assert target.cached_len == len(context) - 1  # all but the pending token
        cached = target.forward(torch.tensor(context[-1:])).logits[-1]
        target.rollback(len(context) - 1)
        fresh = fresh_target.prefill(torch.tensor(context)).logits[-1]
        torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
    assert rejections > 3 and CheckedDraftModelDrafter.checks > 3


def test_seeded_sampling_is_reproducible(target):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True)
    decoder = SpeculativeDecoder(target, DraftModelDrafter(tiny(seed=2), target), 3)
    a = decoder.generate(PROMPT, params, seed=123).token_ids
    b = decoder.generate(PROMPT, params, seed=123).token_ids
    c = decoder.generate(PROMPT, params, seed=124).token_ids
    assert a == b and a != c


def test_always_wrong_drafter_still_emits_one_token_per_step(target):
    plain = plain_greedy(target, PROMPT, 16)
    drafter = OracleDrafter(PROMPT + plain, target.vocab_size)
    result = SpeculativeDecoder(target, drafter, 5).generate(
        PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
    assert result.token_ids == plain
    assert result.stats.steps == 16 and result.stats.acceptance_rate == 0.0
