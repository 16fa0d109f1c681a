"""The closed-loop controller: costs learnt from observed steps, drafter choice, pauses.

Time here is a fake clock that the test's target and drafters advance by what
their passes "cost", so every decision is deterministic (no timed assertions).
"""

from __future__ import annotations

import pytest
import torch

from conftest import OracleDrafter, plain_greedy, tiny
from specdecode import Draft, SamplingParams, SpeculativeDecoder
from specdecode.controller import Controller, OnlineCosts, Slot, context_band, size_bucket
from specdecode.costs import disturbed_points, measure_curve, monotone
from specdecode.drafters import NgramDrafter
from specdecode.drafters.base import MATCH_PRIORS, DraftContext
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.llm import make_controller
from specdecode.speclen import CostModel, LengthPolicy

FLAT = CostModel({1: 1.0, 2: 1.0, 9: 1.0, 65: 1.0})  # what a start-up curve promised


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedTarget:
    """A target whose pass over b tokens advances the clock by cost(b) (1 = a plain step)."""

    def __init__(self, model, clock: Clock, cost) -> None:
        self.model, self.clock, self.cost = model, clock, cost

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, ids, **kw):
        self.clock.now += self.cost(int(ids.shape[0]))
        return self.model.forward(ids, **kw)


class TimedDrafter(OracleDrafter):
    """An oracle drafter whose proposals cost `per_token` plain steps each."""

    name = "costly"

    def __init__(self, truth, vocab_size, script, clock: Clock, per_token: float) -> None:
        super().__init__(truth, vocab_size, script)
        self.clock, self.per_token, self.calls = clock, per_token, 0
        self.timing = (1, 0.0, 0, 0.0)

    def propose(self, ctx):
        k = ctx.k
        self.calls += 1
        self.clock.now += self.per_token * k
        self.timing = (1, self.per_token, k - 1, self.per_token * (k - 1))
        if self.step >= len(self.script):
            self.script = self.script + [self.script[-1]] * 100
        return super().propose(ctx)


def test_buckets_and_bands():
    assert [size_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 17, 65)] == [0, 1, 2, 2, 3, 3, 4, 5, 7]
    assert [context_band(n) for n in (0, 255, 256, 511, 512, 2000)] == [0, 0, 1, 1, 2, 3]


def test_online_costs_correct_the_prior_and_ignore_single_spikes():
    costs = OnlineCosts(CostModel({1: 0.05, 2: 0.05, 9: 0.06, 65: 0.1}))
    assert costs.model(100).c(9) == pytest.approx(1.2)  # nothing seen: the prior
    for _ in range(5):
        costs.observe_pass(1, 0.05, 100)
        costs.observe_pass(9, 0.30, 100)  # batches cost 5x what the prior said
    costs.observe_pass(9, 30.0, 100)  # one disturbed pass: the median does not move
    model = costs.model(100)
    assert model.c(1) == 1.0 and model.c(9) == pytest.approx(6.0)
    assert model.c(2) == pytest.approx(5.0)  # unseen sizes take the nearest bucket's ratio
    assert model.c(65) == pytest.approx(10.0)
    assert costs.plain_seconds(3000) == pytest.approx(0.05)  # the nearest band's plain step


def test_a_cost_curve_measured_under_load_is_repaired_and_not_cached(monkeypatch):
    spike = {1: 1.0, 2: 1.7, 3: 46.1, 4: 1.75, 5: 2.3, 6: 1.19, 8: 3.0}  # the curve
    assert {3, 5} <= disturbed_points(spike)
    fixed = monotone(spike)
    assert fixed[3] == 1.19 and fixed[8] == 3.0 and not disturbed_points(fixed)

    class Model:  # one pass costs b plain steps, but the first pass of size 3 is disturbed
        cached_len, calls = 0, 0

        def prefill(self, ids):
            pass

        def rollback(self, n):
            pass

        def forward(self, ids, last_n=None):
            Model.calls += 1

    times = iter([])

    def fake_curve(model, context, sizes, repeats=3):
        return {b: next(times, None) or float(b) for b in sizes}

    import specdecode.costs as costs_module

    monkeypatch.setattr(costs_module, "others_busy", lambda before: 0.0)  # a quiet machine
    original = costs_module.forward_cost_curve
    try:
        costs_module.forward_cost_curve = fake_curve
        times = iter([1.0, 2.0, 50.0, 4.0])  # b = 3 spiked once, then measured again
        curve, clean = measure_curve(Model(), [1, 2], [1, 2, 3, 4])
        assert clean and curve == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
        costs_module.forward_cost_curve = lambda m, c, s, repeats=3: {
            b: (50.0 if b == 3 else float(b)) for b in s}  # disturbed every time
        curve, clean = measure_curve(Model(), [1, 2], [1, 2, 3, 4])
        assert not clean and curve[3] == 4.0
        costs_module.forward_cost_curve = lambda m, c, s, repeats=3: {b: float(b) for b in s}
        assert measure_curve(Model(), [1, 2], [1, 2, 3, 4])[1]
        monkeypatch.setattr(costs_module, "others_busy", lambda before: 0.6)  # a busy one
        assert not measure_curve(Model(), [1, 2], [1, 2, 3, 4])[1]
    finally:
        costs_module.forward_cost_curve = original


def _run(decoder: SpeculativeDecoder, prompt: list[int], n: int):
    return decoder.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))


def test_the_controller_stops_drafting_when_observed_steps_are_slower_than_plain(target):
    """The prior says verification is free; the real batches cost 1 + 3 steps per extra
    token. An always-right free drafter: drafting stops within a few steps, and the
    output is the target's own."""
    clock, prompt = Clock(), [3, 141, 59]
    truth = prompt + plain_greedy(target, prompt, 80)
    slow = TimedTarget(target, clock, lambda b: 1.0 + 3.0 * (b - 1))
    drafter = OracleDrafter(truth, target.vocab_size, [8] * 200)
    controller = Controller([Slot(drafter, LengthPolicy(FLAT), costly=False)], FLAT)
    decoder = SpeculativeDecoder(slow, k=8, controller=controller, clock=clock)
    out = _run(decoder, prompt, 60)
    assert out.token_ids == truth[len(prompt):len(prompt) + 60]
    drafted = out.stats.drafted_per_step
    assert drafted[0] > 0 and sum(drafted[5:]) == 0
    # The same prior, decided on the prior alone (no observation): it never stops.
    static = Controller([Slot(drafter, LengthPolicy(FLAT), costly=False)], FLAT, online=False)
    out = _run(SpeculativeDecoder(slow, k=8, controller=static, clock=clock), prompt, 60)
    assert min(out.stats.drafted_per_step[:-1]) > 0


def test_a_costly_drafter_that_never_pays_is_paused_and_probed_rarely(target):
    """A draft model that is always wrong: its one-token probes fail, and it is
    paused for 16, then 64 steps (no proposal, so no catch-up); the output is the
    target's."""
    clock, prompt = Clock(), [5, 6, 7]
    truth = prompt + plain_greedy(target, prompt, 220)
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.2 * (b - 1))
    wrong = TimedDrafter(truth, target.vocab_size, [0], clock, per_token=0.1)
    prior = CostModel(FLAT.verify, draft_per_token=0.1)
    controller = Controller([Slot(wrong, LengthPolicy(prior), costly=True)], prior)
    decoder = SpeculativeDecoder(timed, k=8, controller=controller, clock=clock)
    out = _run(decoder, prompt, 200)
    assert out.token_ids == truth[len(prompt):len(prompt) + 200]
    probes = [i for i, d in enumerate(out.stats.drafted_per_step) if d]
    assert len(probes) == 3 and all(out.stats.drafted_per_step[i] == 1 for i in probes)
    assert probes[1] - probes[0] > 16 and probes[2] - probes[1] > 64
    assert wrong.calls == len(probes)  # paused: never asked, so no catch-up either


def test_hybrid_uses_free_drafts_where_they_match_and_the_model_elsewhere(target):
    """A free drafter right only every other step, a costly one always right: both are
    used within one request, and the output is the target's."""
    clock, prompt = Clock(), [9, 8, 7]
    truth = prompt + plain_greedy(target, prompt, 120)

    class Alternating(OracleDrafter):
        name = "lookup"

        def propose(self, ctx):
            context, k = ctx.tokens, ctx.k
            self.step += 1
            if self.step % 2:
                return Draft(torch.tensor(truth[len(context):len(context) + k]))
            return Draft.empty()

    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.05 * (b - 1))
    prior = CostModel(FLAT.verify, draft_per_token=0.1)
    model = TimedDrafter(truth, target.vocab_size, [8], clock, per_token=0.1)
    slots = [Slot(Alternating(truth, target.vocab_size), LengthPolicy(CostModel(FLAT.verify)),
                  costly=False),
             Slot(model, LengthPolicy(prior), costly=True)]
    decoder = SpeculativeDecoder(timed, k=8, controller=Controller(slots, prior), clock=clock)
    out = _run(decoder, prompt, 100)
    assert out.token_ids == truth[len(prompt):len(prompt) + 100]
    assert out.stats.drafter_steps.get("lookup", 0) >= 3
    assert out.stats.drafter_steps.get("costly", 0) >= 3


def test_a_request_keeps_learnt_costs_and_pauses_but_not_acceptance(target):
    clock, prompt = Clock(), [5, 6, 7]
    truth = prompt + plain_greedy(target, prompt, 60)
    wrong = TimedDrafter(truth, target.vocab_size, [0], clock, per_token=0.1)
    prior = CostModel(FLAT.verify, draft_per_token=0.1)
    controller = Controller([Slot(wrong, LengthPolicy(prior), costly=True)], prior)
    timed = TimedTarget(target, clock, lambda b: 1.0 + 3.0 * (b - 1))
    decoder = SpeculativeDecoder(timed, k=8, controller=controller, clock=clock)
    _run(decoder, prompt, 40)
    assert controller.slots[0].paused > 0
    for _ in range(3):
        controller.costs.observe_pass(9, 25.0, 10)
    learnt = controller.cost_model(10).c(9)
    assert learnt == pytest.approx(25.0)
    paused, failures = controller.slots[0].paused, controller.slots[0].failures
    control = controller.begin()
    control.policy(0).observe(8, 0)
    assert control.policy(0).acceptance(1) != [0.9]
    control = controller.begin()
    slot = controller.slots[0]
    assert (slot.paused, slot.failures) == (paused, failures) and control.policy(0).acceptance(
        1) == [0.9]
    assert controller.cost_model(10).c(9) == learnt


def test_tiny_model_costs_do_not_change_output_on_a_real_clock():
    """With the real clock and a real drafter pair, any decision is lossless."""
    from specdecode import DraftModelDrafter, NgramDrafter

    target_model, draft = tiny(seed=1), tiny(seed=2)
    prior = CostModel({1: 1.0, 3: 2.0, 9: 5.0}, draft_per_token=0.3)
    for prompt in ([3, 141, 59, 26], [1, 2, 3, 1, 2, 3, 1, 2]):
        slots = [Slot(NgramDrafter(max_n=2), LengthPolicy(CostModel(prior.verify)), False),
                 Slot(DraftModelDrafter(draft, target_model), LengthPolicy(prior), True)]
        decoder = SpeculativeDecoder(target_model, k=8, controller=Controller(slots, prior))
        assert _run(decoder, prompt, 40).token_ids == plain_greedy(target_model, prompt, 40)


def test_a_start_up_step_measured_under_load_is_replaced_by_measured_plain_steps(target):
    """The prior's plain step took twice what a plain step takes now (the machine was
    busy at load), so drafts looked half their price. A draft model right 2 tokens
    of 8 that costs 0.4 steps a token does not pay: measured plain steps expose it
    and it is paused within a few steps."""
    clock, prompt = Clock(), [4, 3, 2]
    truth = prompt + plain_greedy(target, prompt, 120)
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.6 * (b - 1))
    model = TimedDrafter(truth, target.vocab_size, [4], clock, per_token=0.4)
    prior = CostModel({1: 2.0, 2: 2.2, 9: 3.0}, draft_per_token=0.1)
    controller = Controller([Slot(model, LengthPolicy(prior), costly=True)], prior)
    decoder = SpeculativeDecoder(timed, k=8, controller=controller, clock=clock)
    out = _run(decoder, prompt, 100)
    assert out.token_ids == truth[len(prompt):len(prompt) + 100]
    # judged against the start-up step alone: 21 steps drafted, 116 steps' time
    assert out.stats.drafter_steps.get("costly", 0) <= 8
    assert clock.now < 110


def test_forced_wrong_drafts_are_soon_not_verified(target):
    """The benchmark's adverse case (bench/load.py): the adaptive engine's drafters with
    every token forced wrong. Output unchanged; after the first steps, no draft is
    verified but the draft model's rare one-token probes."""
    from specdecode import DraftModelDrafter, NgramDrafter
    from specdecode.bench.load import force_wrong_drafts
    from specdecode.llm import make_controller

    prior = CostModel({1: 1.0, 2: 1.6, 5: 3.3, 9: 7.0, 65: 27.0}, draft_per_token=0.3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    controller = make_controller(prior, [NgramDrafter(max_n=2)],
                                 DraftModelDrafter(tiny(seed=1), target))  # right when honest
    decoder = SpeculativeDecoder(target, k=16, controller=controller)
    force_wrong_drafts(decoder)
    out = _run(decoder, prompt, 120)
    assert out.token_ids == plain_greedy(target, prompt, 120)
    assert out.stats.accepted == 0
    assert sum(out.stats.drafted_per_step[10:]) <= 3


def test_sizes_the_prior_overprices_are_tried_and_then_used(target):
    """The start-up curve priced long batches 2-4x too high (a busy machine at load
    time); really they cost little. An always-right free drafter: longer cuts are
    verified to measure their cost, and the drafts grow to the whole k."""
    clock, prompt = Clock(), [2, 7, 1]
    truth = prompt + plain_greedy(target, prompt, 400)
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.05 * (b - 1))
    prior = CostModel({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 4.0, 32: 8.0, 64: 16.0})
    drafter = OracleDrafter(truth, target.vocab_size, [63] * 400)
    controller = Controller([Slot(drafter, LengthPolicy(CostModel(prior.verify)), False)],
                            prior)
    decoder = SpeculativeDecoder(timed, k=63, controller=controller, clock=clock)
    out = _run(decoder, prompt, 360)
    assert out.token_ids == truth[len(prompt):len(prompt) + 360]
    assert max(out.stats.drafted_per_step) == 63
    static = Controller([Slot(drafter, LengthPolicy(CostModel(prior.verify)), False)], prior,
                        online=False)
    out = _run(SpeculativeDecoder(timed, k=63, controller=static, clock=clock), prompt, 360)
    assert max(out.stats.drafted_per_step) < 16  # believed the prior: never measured


class TwoKinds(OracleDrafter):
    """Free drafts of two kinds: kind 1 (odd steps) always wrong, kind 4 (even steps)
    always right (as 1-token n-gram matches in chat and 4-token ones in code)."""

    name = "lookup"

    def propose(self, ctx):
        context, k = ctx.tokens, ctx.k
        self.step += 1
        right = self.truth[len(context):len(context) + k]
        if self.step % 2:
            return Draft(torch.tensor([(t + 1) % self.vocab_size for t in right]), kind=1)
        return Draft(torch.tensor(right), kind=4)


def _kinds_run(target, clock, controller, prompt, truth, n):
    """One request through the step API; returns it (its stats and its control)."""
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.5 * (b - 1))
    decoder = SpeculativeDecoder(timed, k=4, controller=controller, clock=clock)
    request = decoder.start(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while not decoder.step(request).finish_reason:
        pass
    assert request.output == truth[len(prompt):len(prompt) + n]
    return request


def test_acceptance_is_estimated_per_kind_of_draft(target):
    """Wrong kind-1 drafts stop being verified, right kind-4 drafts keep being verified
    in the same request (one estimate for both would verify the wrong ones longer or
    the right ones less)."""
    prompt = [6, 1, 8]
    truth = prompt + plain_greedy(target, prompt, 200)
    prior = CostModel({1: 1.0, 2: 1.5, 5: 3.0})
    slot = Slot(TwoKinds(truth, target.vocab_size), LengthPolicy(prior), costly=False)
    request = _kinds_run(target, Clock(), Controller([slot], prior, online=False), prompt,
                         truth, 120)
    stats, control = request.stats, request.control
    assert sum(stats.drafted_per_step[10:]) > 0 and stats.drafted - stats.accepted <= 6
    assert control.policy(0, 1).acceptance(1)[0] < 0.2 < 0.8 < control.policy(0, 4).acceptance(
        1)[0]


def test_a_junk_kind_starts_the_next_request_pessimistic_a_good_one_at_the_prior(target):
    """Across requests only the pessimistic direction is carried, at the prior's weak
    strength: the junk kind's first draft of the next request is not verified; the
    good kind starts at the prior (0.9), not at its near-1.0 estimate."""
    prompt = [6, 1, 8]
    truth = prompt + plain_greedy(target, prompt, 200)
    prior = CostModel({1: 1.0, 2: 1.5, 5: 3.0})
    slot = Slot(TwoKinds(truth, target.vocab_size), LengthPolicy(prior), costly=False)
    controller = Controller([slot], prior, online=False)
    _kinds_run(target, Clock(), controller, prompt, truth, 60)
    control = controller.begin()
    junk, good = control.policy(0, 1).acceptance(2), control.policy(0, 4).acceptance(2)
    assert junk[0] < 0.3 and good == [0.9, 0.9]  # (junk drafts never reach position 2)
    request = _kinds_run(target, Clock(), controller, prompt, truth, 60)
    assert request.stats.drafted_per_step[0] == 0  # the first (kind-1) draft: not verified
    assert control.policy(0).carry_over is False  # kind 0 (one kind only) is not carried


class TwoKindsLookup(TwoKinds):
    """TwoKinds declaring the lookups' priors by match length (as NgramDrafter does)."""

    kind_priors = MATCH_PRIORS


def test_a_fresh_process_verifies_no_short_match_before_hindsight_and_long_ones_at_once(
        target):
    """Lookup slots start each kind of match at the drafter's prior (MATCH_PRIORS): on
    a fresh controller, a 1-token match that is always wrong is never verified, where
    90 % for every kind (a drafter declaring no priors: the negative control) pays
    for its first wrong ones; a right 4-token match is verified from its first
    proposal either way."""
    prompt = [6, 1, 8]
    truth = prompt + plain_greedy(target, prompt, 200)
    prior = CostModel({1: 1.0, 2: 1.5, 5: 3.0})
    runs = {}
    for name, drafter in (("shipped", TwoKindsLookup), ("flat", TwoKinds)):
        slots = make_controller(prior, [drafter(truth, target.vocab_size)], None).slots
        controller = Controller(slots, prior, online=False)
        runs[name] = _kinds_run(target, Clock(), controller, prompt, truth, 40).stats
    for stats in runs.values():
        assert stats.drafted_per_step[1] > 0  # the first (kind-4) draft: verified
    assert runs["shipped"].drafted == runs["shipped"].accepted  # no kind-1 draft verified
    assert runs["flat"].drafted > runs["flat"].accepted  # 90 %: wrong ones verified first


# llama.cpp's default pair on a 2-core Zen 5 (bench/results/auto-both-lookups.json, some sizes)
STEEP = CostModel({1: 1.0, 2: 2.248, 3: 3.221, 5: 5.072, 9: 7.975, 17: 10.263, 21: 10.503,
                   33: 15.804})


def _verified_after_hindsight(confirmed: int, policy: LengthPolicy) -> int:
    """How many tokens of a 20-token kind-4 lookup draft a fresh controller on STEEP
    verifies after hindsight confirmed one earlier match for `confirmed` tokens."""
    controller = Controller([Slot(NgramDrafter(), policy, costly=False)], STEEP, online=False)
    control = controller.begin()
    text = list(range(100, 160))
    earlier = control.policy(0, 4)
    earlier.watch(10, text[10:10 + confirmed])
    for n in range(11, 30):
        earlier.resolve(text[:n])
    plan = controller.plan(control, DraftContext(text[:30], 20),
                           lambda drafter, ctx: Draft(torch.tensor(text[30:50]), kind=4))
    return len(plan.draft)


def test_a_long_free_draft_needs_more_than_a_few_confirmed_positions_on_a_steep_curve():
    """On a steep curve a 20-token draft (c(21) ~10.5 plain steps) pays only at ~95 %
    per position. One match confirmed for 3 tokens raises the pooled estimate to
    0.95 with the weight of ~4 observations; at that point estimate (caution 0, the
    negative control) all 20 are verified (replayed chat answers lost 6-9 % on one
    such draft). Priced at the lower bound (the default caution) none are until 7
    tokens of the match were confirmed; from then on all 20 are."""
    assert _verified_after_hindsight(3, LengthPolicy(STEEP, caution=0.0)) == 20
    assert _verified_after_hindsight(3, LengthPolicy(STEEP)) == 0
    assert _verified_after_hindsight(6, LengthPolicy(STEEP)) == 0
    assert _verified_after_hindsight(7, LengthPolicy(STEEP)) == 20
    assert _verified_after_hindsight(12, LengthPolicy(STEEP)) == 20


@pytest.mark.parametrize("build", ["slot", "single", "make_controller"])
def test_ngram_and_suffix_kinds_start_at_their_match_priors(build):
    """Every way of putting a lookup under control starts kinds 1, 2, 3 at 30, 50 and
    70 % and 4+ (and the pooled estimate) at the policy's 90 %."""
    costs = CostModel({1: 1.0, 2: 1.6, 5: 3.4})
    for drafter in (NgramDrafter(), SuffixDrafter()):
        if build == "slot":
            controller = Controller([Slot(drafter, LengthPolicy(costs), False)], costs)
        elif build == "single":
            controller = Controller.single(drafter, LengthPolicy(CostModel(costs.verify)))
        else:
            controller = make_controller(costs, [drafter], None)
        control = controller.begin()
        starts = [control.policy(0, kind).acceptance(1)[0] for kind in (0, 1, 2, 3, 4)]
        assert starts == pytest.approx([0.9, 0.3, 0.5, 0.7, 0.9])


def test_a_new_kind_after_wrong_drafts_starts_from_the_pooled_estimate(target):
    """Every draft wrong, its kind cycling 1, 2, 3, 4: after the first wrong drafts
    a kind seen for the first time is not verified at the optimistic prior (each
    kind would otherwise cost its own first failures)."""
    prompt = [6, 1, 8]
    truth = prompt + plain_greedy(target, prompt, 120)

    class CyclingWrong(OracleDrafter):
        name = "lookup"

        def propose(self, ctx):
            self.step += 1
            right = self.truth[len(ctx.tokens):len(ctx.tokens) + ctx.k]
            wrong = [(t + 1) % self.vocab_size for t in right]
            return Draft(torch.tensor(wrong), kind=1 + (self.step // 3) % 4)

    prior = CostModel({1: 1.0, 2: 1.5, 5: 3.0})
    slot = Slot(CyclingWrong(truth, target.vocab_size), LengthPolicy(prior), costly=False)
    request = _kinds_run(target, Clock(), Controller([slot], prior, online=False), prompt,
                         truth, 100)
    verified = [i for i, d in enumerate(request.stats.drafted_per_step) if d]
    assert request.stats.accepted == 0 and len(verified) <= 2 and verified[-1] < 3


def test_of_two_free_drafters_each_step_verifies_the_one_that_pays(target):
    """auto's lookups (llm.make_controller): two free drafters propose at every step and
    each is judged in hindsight; the steps verify the right one's drafts, not the one
    whose drafts are always wrong, and the output is the target's own."""
    from specdecode.llm import make_controller

    clock, prompt = Clock(), [4, 8, 15, 16]
    truth = prompt + plain_greedy(target, prompt, 80)

    class Named(OracleDrafter):
        def __init__(self, name: str, script: list[int] | None) -> None:
            super().__init__(truth, target.vocab_size, script)
            self.name = name

    wrong, right = Named("wrong", None), Named("right", [16] * 200)
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.1 * (b - 1))
    controller = make_controller(CostModel({1: 1.0, 9: 1.8, 17: 2.6}), [wrong, right], None)
    decoder = SpeculativeDecoder(timed, k=16, controller=controller, clock=clock)
    out = _run(decoder, prompt, 80)
    assert out.token_ids == truth[len(prompt):]
    assert out.stats.drafter_steps.get("right", 0) >= 4
    assert out.stats.drafter_steps.get("wrong", 0) <= 1
