"""The acceptance-collapse guard (collapse.py) and drafters that raise (engine.py).

Time is the fake clock of tests/test_controller.py: the target's passes advance
it by what they "cost", so every decision is deterministic (no timed asserts).
"""

from __future__ import annotations

import logging

import torch

from conftest import OracleDrafter, plain_greedy
from specdecode import Draft, SamplingParams, SpeculativeDecoder
from specdecode.collapse import PROBE_EVERY, WINDOW, CollapseGuard
from specdecode.controller import Controller, Slot
from specdecode.server.metrics import Metrics
from specdecode.speclen import CostModel, LengthPolicy
from test_controller import Clock, TimedDrafter, TimedTarget

PRIOR = CostModel({1: 1.0, 2: 1.1, 9: 1.8, 65: 7.0})


class PhaseDrafter:
    """A free drafter that knows the target's greedy sequence `truth`: its k tokens are
    right, except while the context length is in [bad_from, bad_to) (all wrong)."""

    name = "phase"

    def __init__(self, truth: list[int], vocab_size: int, bad_from: int, bad_to: int) -> None:
        self.truth, self.vocab_size = truth, vocab_size
        self.bad = range(bad_from, bad_to)
        self.calls: list[int] = []  # context lengths it was asked at

    def begin(self, prompt_ids, params, generator) -> None:
        pass

    def propose(self, ctx) -> Draft:
        n = len(ctx.tokens)
        self.calls.append(n)
        right = self.truth[n:n + ctx.k]
        shift = 1 if n in self.bad else 0
        return Draft(torch.tensor([(t + shift) % self.vocab_size for t in right],
                                  dtype=torch.long))

    def observe(self, num_accepted: int) -> None:
        pass


def _decoder(target, drafter, clock: Clock) -> SpeculativeDecoder:
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.1 * (b - 1))
    slot = Slot(drafter, LengthPolicy(CostModel(PRIOR.verify)), costly=False)
    return SpeculativeDecoder(timed, k=8, controller=Controller([slot], PRIOR), clock=clock)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_the_guard_engages_after_a_window_and_releases_on_a_paid_step():
    guard = CollapseGuard(window=4, probe_every=3)
    for _ in range(3):
        guard.below()
    assert not guard.engaged
    guard.below()
    assert guard.engaged and guard.engagements == 1
    assert [guard.probe_now() for _ in range(6)] == [False, False, True, False, False, True]
    assert guard.plain_steps == 4
    guard.paid()
    assert not guard.engaged and guard.probe_now() and guard.run == 0


def test_collapse_mid_request_engages_the_guard_probes_rarely_and_recovers(target):
    """Right drafts, then 240 tokens of wrong ones, then right ones again: the guard
    engages (speculation off), the drafter is asked about once in PROBE_EVERY steps
    meanwhile, speculation resumes when drafts are right again; output = plain."""
    clock, prompt = Clock(), [3, 141, 59]
    n = 420
    truth = prompt + plain_greedy(target, prompt, n)
    drafter = PhaseDrafter(truth, target.vocab_size, 60, 300)
    decoder = _decoder(target, drafter, clock)
    request = decoder.start(prompt, _params(n))
    paused_at: list[int] = []
    while request.finish_reason is None:
        event = decoder.step(request)
        if event.stats.speculation_paused:
            paused_at.append(len(request.context))
    stats = request.stats
    assert request.output == truth[len(prompt):]
    assert stats.guard_engagements >= 1 and stats.guard_plain_steps > 100
    assert paused_at and 60 < paused_at[0] < 60 + 2 * WINDOW
    asked = [c for c in drafter.calls if paused_at[0] < c < 300]
    steps = 300 - paused_at[0]  # all plain in the wrong stretch: one token each
    assert len(asked) <= steps // PROBE_EVERY + 2  # probes only
    assert not stats.speculation_paused  # recovered after the wrong stretch
    late = [d for d, c in zip(stats.drafted_per_step, range(len(stats.drafted_per_step)))
            if c > len(stats.drafted_per_step) - 10]
    assert sum(late) > 0  # drafting again at the end


def test_the_guard_spans_requests_and_is_reported(target):
    """A drafter that is always wrong: the first request engages the guard; the second
    starts with speculation off (plain from its first step, probes only); the
    server's counter and gauge say so."""
    clock, prompt = Clock(), [5, 6, 7]
    truth = prompt + plain_greedy(target, prompt, 120)
    drafter = PhaseDrafter(truth, target.vocab_size, 0, 10**9)
    decoder = _decoder(target, drafter, clock)
    metrics = Metrics()
    metrics.watch_guard(decoder.controller)
    first = decoder.generate(prompt, _params(120))
    assert first.token_ids == truth[len(prompt):]
    assert first.stats.speculation_paused and first.stats.guard_engagements == 1
    metrics.observe_generation("finished", 3, 120, first.stats)
    second = decoder.generate(prompt, _params(40))
    assert second.stats.guard_engagements == 0 and second.stats.speculation_paused
    assert second.stats.guard_plain_steps >= 40 - 40 // PROBE_EVERY - 1
    assert second.token_ids == truth[len(prompt):len(prompt) + 40]
    text = metrics.render()[0].decode()
    assert "specdecode_guard_engagements_total 1.0" in text
    assert "specdecode_speculation_paused 1.0" in text
    assert second.stats.to_dict()["guard_plain_steps"] == second.stats.guard_plain_steps


class RaisingDrafter(OracleDrafter):
    """An oracle drafter (always right) that raises at its `fail_at`-th proposal."""

    name = "raising"

    def __init__(self, truth, vocab_size, fail_at: int = 3) -> None:
        super().__init__(truth, vocab_size, [8] * 1000)
        self.fail_at, self.calls = fail_at, 0

    def propose(self, ctx) -> Draft:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter broke")
        return super().propose(ctx)


def test_a_drafter_that_raises_is_switched_off_and_the_output_is_plain(target, caplog):
    """Greedy float32: a drafter raising at its 3rd call; the request completes, the
    output is plain decoding's, the error is logged once and counted, and the
    drafter is not asked again in that request (asked again in the next)."""
    prompt = [7, 8, 9]
    truth = prompt + plain_greedy(target, prompt, 40)
    drafter = RaisingDrafter(truth, target.vocab_size)
    decoder = SpeculativeDecoder(target, drafter, k=4, prefix_cache=False)
    with caplog.at_level(logging.WARNING, logger="specdecode.engine"):
        out = decoder.generate(prompt, _params(40))
    assert out.token_ids == truth[len(prompt):]
    assert drafter.calls == 3 and out.stats.drafter_errors == 1
    assert out.stats.drafted_per_step[:2] == [4, 4] and sum(out.stats.drafted_per_step[2:]) == 0
    warnings = [r for r in caplog.records if "raised in propose" in r.getMessage()]
    assert len(warnings) == 1
    drafter.fail_at = -1
    again = decoder.generate(prompt, _params(40))
    assert again.token_ids == out.token_ids and again.stats.drafter_errors == 0
    assert drafter.calls > 3


def test_under_a_controller_the_other_drafter_continues(target):
    """Two free drafters, the first raises at its 3rd call: its slot is left out, the
    second keeps drafting; the output is plain decoding's."""
    clock, prompt = Clock(), [2, 4, 6]
    truth = prompt + plain_greedy(target, prompt, 60)
    broken = RaisingDrafter(truth, target.vocab_size)
    good = PhaseDrafter(truth, target.vocab_size, 0, 0)
    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.1 * (b - 1))
    slots = [Slot(d, LengthPolicy(CostModel(PRIOR.verify)), costly=False)
             for d in (broken, good)]
    decoder = SpeculativeDecoder(timed, k=8, controller=Controller(slots, PRIOR), clock=clock)
    out = decoder.generate(prompt, _params(60))
    assert out.token_ids == truth[len(prompt):]
    assert broken.calls == 3 and out.stats.drafter_errors == 1
    assert out.stats.drafter_steps.get("phase", 0) >= 3


def test_the_cli_warns_in_one_line_when_the_guard_engaged():
    from specdecode.cli import guard_warning
    from specdecode.stats import SpecStats

    assert guard_warning(SpecStats(steps=10)) is None
    line = guard_warning(SpecStats(steps=100, guard_plain_steps=60, guard_engagements=1))
    assert line.startswith("specdecode: warning:") and "60 of 100 steps" in line
    assert "\n" not in line


class TimedDraftModel(TimedDrafter):
    """A TimedDrafter the engine takes for a draft model (it has one)."""

    draft_model = "a draft model"


def _fixed_default(target, drafter, clock: Clock) -> SpeculativeDecoder:
    """The fixed-k default's engine (llm.guarded_controller) on a flat cost curve, a
    draft token costing 0.3 plain steps."""
    from specdecode.llm import guarded_controller

    timed = TimedTarget(target, clock, lambda b: 1.0 + 0.01 * (b - 1))
    controller = guarded_controller(drafter, CostModel({1: 1.0, 2: 1.0}, draft_per_token=0.3))
    return SpeculativeDecoder(timed, k=8, controller=controller, clock=clock)


def test_the_fixed_k_default_drafts_k_while_drafts_pay(target):
    """Right drafts: no one-token probe first, and drafts grow to k = 8."""
    clock, prompt = Clock(), [3, 141, 59]
    truth = prompt + plain_greedy(target, prompt, 160)
    drafter = TimedDraftModel(truth, target.vocab_size, [8], clock, per_token=0.3)
    result = _fixed_default(target, drafter, clock).generate(prompt, _params(160))
    assert result.token_ids == truth[len(prompt):]
    drafted = [d for d in result.stats.drafted_per_step if d]
    assert drafted[0] > 1 and drafted[1:-1].count(8) >= len(drafted) - 4
    assert result.stats.guard_engagements == 0 and result.stats.accepted >= 130  # of 160


def test_the_fixed_k_default_stops_drafting_when_every_draft_fails(target):
    """Always-wrong drafts (what `specdecode check` forces for its fallback check):
    the output is plain's, a few drafts are tried, then the guard has speculation
    off (without it, fixed k verified 8 wrong tokens at every step: 0.26x)."""
    clock, prompt = Clock(), [5, 6, 7]
    truth = prompt + plain_greedy(target, prompt, 200)
    drafter = TimedDraftModel(truth, target.vocab_size, [0], clock, per_token=0.3)
    result = _fixed_default(target, drafter, clock).generate(prompt, _params(200))
    assert result.token_ids == truth[len(prompt):]
    stats = result.stats
    assert sum(stats.drafted_per_step) <= 16 and stats.accepted == 0
    assert stats.guard_engagements == 1 and stats.speculation_paused
    assert clock.now < 200 * 1.1  # what plain steps would cost, plus the few drafts


class TimedHead(TimedDrafter):
    """A drafter with no draft model whose tokens cost compute (a trained head)."""

    priced = True


def test_a_trained_head_is_priced_per_token(target):
    """The fixed-k default prices a head's tokens (drafters.base: priced): right drafts
    whose tokens cost 1.5 plain steps each never pay, so after its first drafts the
    head is seldom asked; the same drafter unpriced (free) drafts at every step."""
    def run(drafter_cls):
        clock, prompt = Clock(), [3, 141, 59]
        truth = prompt + plain_greedy(target, prompt, 160)
        drafter = drafter_cls(truth, target.vocab_size, [8], clock, per_token=1.5)
        decoder = _fixed_default(target, drafter, clock)
        result = decoder.generate(prompt, _params(160))
        assert result.token_ids == truth[len(prompt):]
        return decoder.controller.slots[0].costly, sum(result.stats.drafted_per_step)

    priced, drafted = run(TimedHead)
    free, drafted_free = run(TimedDrafter)
    assert priced and not free
    assert drafted <= 30 and drafted_free >= 100
