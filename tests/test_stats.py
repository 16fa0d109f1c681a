"""Metric arithmetic on scripted runs: known accepted counts give known numbers."""

from __future__ import annotations

import pytest

from conftest import OracleDrafter, plain_greedy
from specdecode import SamplingParams, SpecStats, SpeculativeDecoder

PROMPT = [3, 141, 59, 26, 53]


def test_scripted_acceptance_gives_known_metrics(target):
    script = [4, 2, 0, 3, 1]  # correct tokens per step, k = 4
    plain = plain_greedy(target, PROMPT, 60)
    drafter = OracleDrafter(PROMPT + plain, target.vocab_size, script)
    decoder = SpeculativeDecoder(target, drafter, 4)
    events = []
    for event in decoder.stream(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True)):
        events.append(event)
        if len(events) == len(script):
            break
    stats = events[-1].stats
    assert [len(e.token_ids) for e in events] == [a + 1 for a in script]
    assert (stats.steps, stats.drafted, stats.accepted, stats.emitted) == (5, 20, 10, 15)
    assert stats.acceptance_rate == pytest.approx(0.5)
    assert stats.mean_accepted_length == pytest.approx(3.0)
    assert stats.position_tried == [5, 4, 3, 2]
    assert stats.position_accepted == [4, 3, 2, 1]
    assert stats.position_acceptance == pytest.approx([0.8, 0.75, 2 / 3, 0.5])
    assert stats.accepted_per_step == script
    assert [t for e in events for t in e.token_ids] == plain[:15]


def test_plain_decoding_has_tau_one(target):
    stats = SpeculativeDecoder(target, None).generate(
        PROMPT, SamplingParams(max_tokens=7, ignore_eos=True)).stats
    assert (stats.steps, stats.drafted, stats.mean_accepted_length) == (7, 0, 1.0)
    assert stats.acceptance_rate == 0.0 and stats.position_acceptance == []
    assert stats.decode_time > 0 and stats.tokens_per_second > 0


def test_merge_adds_runs():
    a, b = SpecStats(), SpecStats()
    a.record_step(drafted=3, accepted=3, emitted=4, tried=3)
    b.record_step(drafted=2, accepted=0, emitted=1, tried=1)
    b.record_step(drafted=4, accepted=1, emitted=2, tried=2)
    m = a.merge(b)
    assert (m.steps, m.drafted, m.accepted, m.emitted) == (3, 9, 4, 7)
    assert m.position_tried == [3, 2, 1] and m.position_accepted == [2, 1, 1]
    assert m.to_dict()["mean_accepted_length"] == pytest.approx(7 / 3)
