"""Adaptive speculation length: cost arithmetic, the policy, and losslessness."""

from __future__ import annotations

import pytest

from conftest import OracleDrafter, plain_greedy, tiny
from specdecode import DraftModelDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from specdecode.speclen import CostModel, LengthPolicy, best_length, wilson_lower

# llama.cpp's CPU curve as measured on a 2-core CPU (ms): up to b = 8 a batch costs almost b steps.
LLAMA_CPP = CostModel({1: 35, 2: 65, 3: 83, 4: 106, 8: 221, 16: 253, 32: 452})


def test_cost_curve_is_normalised_and_interpolated():
    assert LLAMA_CPP.c(1) == 1.0
    assert LLAMA_CPP.c(16) == pytest.approx(253 / 35)
    assert LLAMA_CPP.c(6) == pytest.approx((106 + (221 - 106) / 2) / 35)
    assert LLAMA_CPP.c(48) == pytest.approx((452 + 16 * (452 - 253) / 16) / 35)  # last slope
    assert CostModel.flat().c(17) == 1.0
    with pytest.raises(ValueError, match="c\\(1\\)"):
        CostModel({2: 1.0})


def test_best_length_weighs_tokens_against_cost():
    # Flat cost: any positive acceptance makes the longest draft best.
    assert best_length(CostModel.flat(), [0.5] * 8, 8) == (8, pytest.approx(2 - 0.5 ** 8))
    # llama.cpp's curve: 16 sure tokens for 7.2 steps pay, 4 sure tokens for 3.03 a little.
    assert best_length(LLAMA_CPP, [1.0] * 15, 15) == (15, pytest.approx(16 * 35 / 253))
    assert best_length(LLAMA_CPP, [1.0] * 3, 3) == (3, pytest.approx(4 * 35 / 106))
    # ...but at 60 % acceptance no length beats a plain step.
    assert best_length(LLAMA_CPP, [0.6] * 15, 15) == (0, 1.0)
    # At 90 %: 1.9 tokens for c(2) = 1.86 steps pays a little, 2.71 for c(3) = 2.37 more.
    assert best_length(LLAMA_CPP, [0.9] * 2, 2) == (2, pytest.approx(2.71 * 35 / 83))


def test_drafting_cost_counts_unless_already_spent():
    costs = CostModel({1: 1.0, 9: 1.0}, draft_per_token=0.6)
    # 8 drafts at 0.9: 1 + sum 0.9^i = 6.13 tokens for 1 + 4.8 steps -> 1.06x at L=8;
    length, rate = best_length(costs, [0.9] * 8, 8)
    expected = max((1 + sum(0.9 ** i for i in range(1, n + 1))) / (1 + 0.6 * n)
                   for n in range(1, 9))
    assert rate == pytest.approx(expected) and length > 0
    assert best_length(costs, [0.5] * 8, 8) == (0, 1.0)
    assert best_length(costs, [0.5] * 8, 8, drafted=True)[0] == 8  # verifying is free


def test_policy_learns_acceptance_and_relaxes_to_its_prior():
    costly = CostModel({1: 1.0, 9: 1.0}, draft_per_token=0.3)
    policy = LengthPolicy(costly)
    assert policy.acceptance(3) == [0.9] * 3  # the prior
    assert policy.length(8) > 0
    for _ in range(40):  # every draft rejected at its first token
        policy.observe(8, 0)
    a = policy.acceptance(8)
    assert a[0] < 0.2 and a[1] == pytest.approx(0.9)  # position 2 never judged
    assert policy.length(8) == 0
    idle = 0
    while policy.length(8) == 0:  # steps without a draft: drift back to the prior
        policy.observe(0, 0)
        idle += 1
    assert 5 < idle < 60
    for _ in range(40):  # long drafts all accepted
        policy.observe(8, 8)
    assert policy.length(8) == 8
    assert "draft length 8 of 8" in policy.describe(8)


def test_free_drafts_are_judged_in_hindsight_position_by_position():
    policy = LengthPolicy(LLAMA_CPP, prior=(3.0, 4.0), decay=1.0)  # plain counts
    sequence = list(range(100))
    policy.watch(10, sequence[10:20])  # ten right tokens
    policy.resolve(sequence[:10])  # nothing known yet
    assert policy.acceptance(2) == [0.75, 0.75] and len(policy._watched) == 1
    policy.resolve(sequence[:14])  # four confirmed: position 1 + 3 pooled, still watched
    assert policy.acceptance(2) == [4 / 5, 6 / 7] and len(policy._watched) == 1
    policy.resolve(sequence[:30])  # the other six: done
    assert policy.acceptance(2) == [4 / 5, 12 / 13] and policy._watched == []
    policy.watch(40, [40, 41, -1, 43])  # wrong at position 3: judged there, then dropped
    policy.resolve(sequence[:42])
    assert len(policy._watched) == 1
    policy.resolve(sequence[:43])
    assert policy.acceptance(3) == [5 / 6, 13 / 15, 13 / 15] and policy._watched == []
    policy.watch(99, [99, 100])  # the sequence never gets past 99: a new request forgets it
    policy.begin()
    policy.resolve(sequence + [100])
    assert policy.acceptance(2) == [0.75, 0.75] and policy._watched == []


def test_long_copies_earn_long_drafts_within_a_few_steps():
    """Every step proposes 64 tokens of a long copy: the policy starts at its prior
    (short drafts on llama.cpp's curve) and reaches the full length within a few steps."""
    policy = LengthPolicy(LLAMA_CPP)
    sequence, position, lengths = list(range(1000)), 100, []
    for _ in range(12):
        policy.resolve(sequence[:position])
        policy.watch(position, sequence[position:position + 64])
        length = policy.length(64, drafted=True)
        lengths.append(length)
        position += length + 1
    assert lengths[0] < 16 and lengths[-1] == 64


@pytest.mark.parametrize("costs", [LLAMA_CPP, CostModel({1: 1.0, 5: 1.0}, 0.5)],
                         ids=["llama.cpp", "flat+draft"])
def test_greedy_output_is_unchanged_by_the_policy(target, costs):
    draft = tiny(seed=2)
    for prompt in ([3, 141, 59, 26], [1, 2, 3, 1, 2, 3, 1, 2]):
        plain = plain_greedy(target, prompt, 40)
        for drafter in (DraftModelDrafter(draft, target), NgramDrafter(max_n=2)):
            decoder = SpeculativeDecoder(target, drafter, 8, length_policy=LengthPolicy(costs))
            out = decoder.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
            assert out.token_ids == plain


@pytest.mark.parametrize(("costs", "right", "lengths"), [
    # Right 2 of 8: a_1 = 1, later positions 1 in 2 -> 2 tokens for c(2) = 1.86 steps.
    (LLAMA_CPP, 2, {1}),
    (LLAMA_CPP, 0, {0}),  # nothing right: plain steps
    (CostModel.flat(), 6, {8}),  # verifying is free: the whole draft
])
def test_policy_cuts_drafts_in_the_engine(target, costs, right, lengths):
    """A scripted drafter right `right` tokens of 8 every step: the policy learns (in
    hindsight) where its drafts go wrong and verifies only what pays."""
    prompt = [3, 141, 59]
    truth = prompt + plain_greedy(target, prompt, 80)
    drafter = OracleDrafter(truth, target.vocab_size, [right] * 100)
    decoder = SpeculativeDecoder(target, drafter, 8, length_policy=LengthPolicy(costs))
    out = decoder.generate(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    assert out.token_ids == truth[len(prompt):len(prompt) + 60]
    middle = len(out.stats.drafted_per_step) // 2  # learnt, and before the budget ends
    assert set(out.stats.drafted_per_step[middle:middle + 3]) == lengths


def test_auto_drafter_keeps_a_draft_model_only_where_it_can_pay():
    from types import SimpleNamespace

    from specdecode.drafters import BaseDrafter
    from specdecode.llm import choose_drafter

    closed = []
    draft = BaseDrafter()
    draft.draft_model = SimpleNamespace(close=lambda: closed.append(True))
    cheap = CostModel({1: 1.0, 9: 1.1}, draft_per_token=0.1)  # a GPU-like curve
    proposer, why = choose_drafter(cheap, draft, 8)
    assert proposer is draft and "n-gram and suffix lookup + the draft model" in why and not closed
    costly = CostModel(LLAMA_CPP.verify, draft_per_token=0.5)  # llama.cpp on 2 cores
    proposer, why = choose_drafter(costly, draft, 16)
    assert proposer is None and closed == [True]
    assert "n-gram and suffix lookup only" in why and "c_draft 0.50" in why
    assert "too little to pay" in why
    assert choose_drafter(cheap, None, 8) == (None, "n-gram and suffix lookup (no draft model)")


def test_a_request_starts_from_the_prior_not_from_the_last_request():
    """A long copy, then a request whose drafts are always wrong: the second
    request's draft lengths are those of a fresh policy (carried over, the copy's
    confident estimates kept verifying wrong drafts on a random prompt)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def second_request(decoder: SpeculativeDecoder) -> list[int]:
        prompt = [7, 8, 9]
        truth = prompt + plain_greedy(target_model, prompt, 50)
        decoder.drafter = OracleDrafter(truth, target_model.vocab_size, [0] * 100)
        return decoder.generate(prompt, params).stats.drafted_per_step

    target_model = tiny(seed=1)
    copy_prompt = [3, 141, 59]
    copy_truth = copy_prompt + plain_greedy(target_model, copy_prompt, 80)
    used = SpeculativeDecoder(target_model, OracleDrafter(copy_truth, target_model.vocab_size,
                                                          [8] * 100),
                              8, length_policy=LengthPolicy(LLAMA_CPP))
    first = used.generate(copy_prompt, params).stats.drafted_per_step
    assert max(first) == 8
    fresh = SpeculativeDecoder(target_model, None, 8, length_policy=LengthPolicy(LLAMA_CPP))
    assert second_request(used) == second_request(fresh)
    assert sum(second_request(fresh)) <= 4  # learnt in a step or two


@pytest.mark.parametrize("pool_from", [1, 2, 3])
def test_free_drafts_are_priced_at_the_lower_bound_from_the_pooled_positions(pool_from):
    """priced(k): k values; the positions before pool_from as estimated, the pooled ones
    at the Wilson bound of their counts, below the estimate with few observations;
    caution 0: the estimates themselves."""
    costs = CostModel({1: 1.0, 2: 2.0})
    policy, point_only = (LengthPolicy(costs, pool_from=pool_from, caution=c) for c in (0.5, 0))
    for p in (policy, point_only):
        p.watch(0, [1, 2, 3, 4, 9])
        p.resolve([1, 2, 3, 4, 5])  # 4 confirmed, the 5th wrong
    for k in (0, 1, pool_from - 1, pool_from, 6):
        point, priced = policy.acceptance(k), policy.priced(k)
        assert len(priced) == k and point_only.priced(k) == point_only.acceptance(k)
        assert priced[:pool_from - 1] == point[:pool_from - 1]
        assert all(b < a - 0.05 for a, b in zip(point[pool_from - 1:], priced[pool_from - 1:]))
        assert len(set(priced[pool_from - 1:])) <= 1  # one pooled estimate
    with pytest.raises(ValueError):
        LengthPolicy(costs, caution=-1.0)


def test_wilson_lower_bound():
    """Below the observed rate with few observations, close to it with many; z 0: the
    rate; nothing tried: 0; never below 0 or above 1."""
    assert wilson_lower(9.0, 10.0, 0.5) < 0.9 - 0.04 and wilson_lower(9.0, 10.0, 0.0) == 0.9
    assert 0.9 - 0.01 < wilson_lower(900.0, 1000.0, 0.5) < 0.9
    assert wilson_lower(0.0, 0.0, 0.5) == 0.0 and wilson_lower(0.0, 3.7, 0.5) == 0.0
    assert 0.0 < wilson_lower(5.0, 5.0, 1.0) < 1.0
    assert wilson_lower(9.0, 10.0, 1.96) == pytest.approx(0.5958, abs=1e-4)  # the 95 % interval
    assert wilson_lower(2.5, 2.9, 0.5) < wilson_lower(2.5, 2.9, 0.25) < 2.5 / 2.9


def test_anew_keeps_every_setting_and_starts_the_estimates_at_the_prior():
    """LengthPolicy.anew: each public field as this policy's (or as changed), the
    counts back to the prior (what Slot.fresh_policy builds each request from)."""
    costs = CostModel({1: 1.0, 2: 2.0})
    policy = LengthPolicy(costs, (1.0, 2.0), 0.9, 3, carry_over=True, caution=0.7)
    policy.observe(3, 0)
    fresh = policy.anew(prior=(1.5, 2.0))
    assert (fresh.costs, fresh.decay, fresh.pool_from, fresh.carry_over, fresh.caution) == (
        costs, 0.9, 3, True, 0.7)
    assert fresh.prior == (1.5, 2.0) and fresh.acceptance(3) == [0.75] * 3
    assert policy.acceptance(1)[0] < 0.5  # the original keeps its own counts
