"""The replay benchmarks (bench/llama_cpp/replay.py, agent_replay.py): recorded texts
through the real engine, priced by a cost curve, without a model."""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import pytest

from specdecode.speclen import CostModel

BENCH = Path(__file__).resolve().parents[1] / "bench" / "llama_cpp"


@pytest.fixture(scope="module")
def agent_replay():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("agent_replay")
    finally:
        sys.path.remove(str(BENCH))


STEEP = CostModel({1: 1.0, 2: 1.9, 4: 3.8, 8: 7.0, 17: 11.0, 33: 18.0, 65: 30.0})
FLAT = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 17: 1.6, 33: 2.5, 65: 4.5})
VOCAB, EOS = 500, (499,)


def rates(agent_replay, texts, curve):
    """{policy: tokens per plain step} over all texts."""
    out = {}
    for policy in ("auto", "ngram", "suffix", "ngram-mod", "hindsight", "ceiling"):
        tallies = agent_replay.replay(texts, policy, curve, VOCAB, EOS).values()
        tokens, steps = map(sum, zip(*tallies, strict=True))
        out[policy] = tokens / steps
    return out


def test_a_text_that_restates_its_prompt_replays_near_the_ceiling(agent_replay):
    rng = random.Random(0)
    source = [rng.randrange(1, 400) for _ in range(300)]
    texts = [("edit", source, source[:200])]
    for curve in (STEEP, FLAT):
        r = rates(agent_replay, texts, curve)
        assert r["ceiling"] >= r["hindsight"] >= r["auto"] > 1.0
        assert r["hindsight"] >= 0.8 * r["ceiling"]
        assert r["auto"] >= 0.6 * r["hindsight"], r
    # On the flat curve long drafts pay: the ceiling is several times plain.
    assert rates(agent_replay, texts, FLAT)["ceiling"] > 10


def test_text_with_nothing_to_look_up_replays_at_plain_speed(agent_replay):
    rng = random.Random(1)
    prompt = list(range(1, 60))
    output = [rng.randrange(100, 499) for _ in range(120)]
    r = rates(agent_replay, [("chat", prompt, output)], STEEP)
    assert r["auto"] == pytest.approx(1.0, abs=0.05)
    assert r["hindsight"] == pytest.approx(1.0, abs=0.02)
    assert r["ceiling"] > 1.0


def test_the_store_carries_an_earlier_texts_answer_to_the_next(agent_replay):
    """A second request whose answer repeats the first's answer (not its own prompt)
    is drafted from the suffix store: the replay keeps one store across texts."""
    rng = random.Random(2)
    answer = [rng.randrange(100, 499) for _ in range(150)]
    first = ("agent turn 1", list(range(1, 40)), answer)
    second = ("agent turn 2", list(range(40, 80)), answer)
    alone = agent_replay.replay([second], "auto", STEEP, VOCAB, EOS)["agent turn 2"]
    after = agent_replay.replay([first, second], "auto", STEEP, VOCAB, EOS)["agent turn 2"]
    assert alone[1] == pytest.approx(len(answer), rel=0.05)  # nothing to look up alone
    assert after[1] < 0.8 * alone[1]
