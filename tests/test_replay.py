"""The replay benchmarks (bench/llama_cpp/replay.py, agent_replay.py): recorded texts
through the real engine, priced by a cost curve, without a model."""

from __future__ import annotations

import importlib
import itertools
import random
import sys
from pathlib import Path

import pytest

import real
from specdecode.bench import workloads
from specdecode.models import loading
from specdecode.speclen import CostModel

BENCH = Path(__file__).resolve().parents[1] / "bench" / "llama_cpp"


@pytest.fixture(scope="module")
def ar():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("agent_replay")
    finally:
        sys.path.remove(str(BENCH))


STEEP = CostModel({1: 1.0, 2: 1.9, 4: 3.8, 8: 7.0, 17: 11.0, 33: 18.0, 65: 30.0})
FLAT = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 17: 1.6, 33: 2.5, 65: 4.5})
VOCAB, EOS = 500, (499,)


def rates(ar, texts, curve) -> dict[str, float]:
    """{policy: tokens per plain step} over all texts."""
    out = {}
    for policy in ar.POLICIES:
        tallies = ar.replay(texts, policy, curve, VOCAB, EOS).values()
        tokens, steps = map(sum, zip(*tallies, strict=True))
        out[policy] = tokens / steps
    return out


def test_a_text_that_restates_its_prompt_replays_between_auto_and_the_bounds(ar):
    rng = random.Random(0)
    source = [rng.randrange(1, 400) for _ in range(300)]
    texts = [ar.Text("edit", source, source[:200])]
    for curve in (STEEP, FLAT):  # monotone curves: no policy beats the hindsight bound
        r = rates(ar, texts, curve)
        assert r["ceiling"] >= r["hindsight"] >= max(r["auto"], r["ngram"], r["suffix"],
                                                     r["ngram-mod"])
        assert r["hindsight"] >= 0.9 * r["ceiling"]  # every token but the first is copied
        assert r["auto"] >= 0.6 * r["hindsight"] and r["auto"] > 1.5, r
    assert rates(ar, texts, FLAT)["ceiling"] > 10  # long drafts pay on a flat curve


def test_text_with_nothing_to_look_up_replays_at_plain_speed(ar):
    rng = random.Random(1)
    prompt = list(range(1, 60))
    output = [rng.randrange(100, 499) for _ in range(120)]
    r = rates(ar, [ar.Text("chat", prompt, output)], STEEP)
    assert r["auto"] == pytest.approx(1.0, abs=0.05)
    assert r["hindsight"] == pytest.approx(1.0, abs=0.02)


def brute_force(n: int, curve: CostModel, accepted: list[int], k: int) -> float:
    """Least cost over every split of n tokens into passes (the rules of fewest_steps)."""
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 0
            size += 1
        sizes.append(size)
        at, ok = 0, True
        for b in sizes:
            ok = ok and b <= k + 1 and b - 1 <= accepted[at]
            at += b
        if ok:
            best = min(best, sum(curve.c(b) for b in sizes))
    return best


def test_fewest_steps_is_the_best_split(ar):
    """The bound is the least cost over all splits, not a greedy split (on this curve
    greedy by rate takes 3 + 1 for 4 tokens: 1.5 + 1; two passes of 2 cost 2.4)."""
    odd = CostModel({1: 1.0, 2: 1.2, 3: 1.5, 4: 3.0, 65: 60.0})
    assert ar.fewest_steps(4, odd, [3, 3, 3, 3]) == pytest.approx(2.4)
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randrange(1, 11)
        accepted = [rng.randrange(0, 6) for _ in range(n)]
        for curve in (odd, STEEP, FLAT):
            assert ar.fewest_steps(n, curve, accepted) == pytest.approx(
                brute_force(n, curve, accepted, ar.K))
    assert ar.fewest_steps(7, STEEP, [0] * 7) == pytest.approx(7.0)  # nothing right: plain


def test_the_store_carries_a_trajectorys_answer_to_its_next_turn(ar):
    """A later turn whose answer repeats the first turn's answer (not its own prompt) is
    drafted from the suffix store; a cold request starts with it empty, as in compare.py."""
    rng = random.Random(2)
    answer = [rng.randrange(100, 499) for _ in range(150)]
    first = ar.Text("agent turn 1", list(range(1, 40)), answer)
    later = ar.Text("agent turn 2", list(range(40, 80)), answer, cold=False)
    fresh = ar.Text("agent turn 2", later.prompt, answer, cold=True)
    for policy in ("auto", "suffix", "hindsight"):
        alone = ar.replay([later], policy, STEEP, VOCAB, EOS)["agent turn 2"][1]
        after = ar.replay([first, later], policy, STEEP, VOCAB, EOS)["agent turn 2"][1]
        cleared = ar.replay([first, fresh], policy, STEEP, VOCAB, EOS)["agent turn 2"][1]
        assert alone == pytest.approx(len(answer), rel=0.05)  # nothing to look up alone
        assert after < 0.8 * alone, policy
        assert cleared == pytest.approx(alone)


def test_recorded_texts_rebuild_each_turn_as_compare_does(ar):
    """A trajectory's turn 2 prompt is its messages, the recorded turn-1 answer and the
    follow-up, through the chat template (compare.py: p.turn_ids); a prompt whose
    length differs from the one recorded is refused."""
    tok = loading.load_tokenizer(real.path("smollm2-135m"))
    p = next(q for q in workloads.load("agent", 99) if q.followups)
    answer = tok.encode("def f(x):\n    return x\n")
    turn2 = p.turn_ids(tok, [tok.decode(answer)])
    runs = [{"workload": "agent", "prompt": f"{p.name}/turn1", "turn": 1, "config": "c",
             "tokens": answer, "prompt_tokens": len(p.ids(tok))},
            {"workload": "agent", "prompt": f"{p.name}/turn2", "turn": 2, "config": "c",
             "tokens": [5, 6], "prompt_tokens": len(turn2)},
            {"workload": "agent", "prompt": f"{p.name}/turn1", "turn": 1, "config": "other",
             "tokens": [7], "prompt_tokens": 1}]
    texts = ar.recorded_texts(runs, "c", tok)
    assert [t.prompt for t in texts] == [p.ids(tok), turn2]
    assert [t.cold for t in texts] == [True, False]
    assert [t.cls for t in texts] == ["agent turn 1", "agent turn 2"]
    runs[1]["prompt_tokens"] += 1
    with pytest.raises(ValueError, match="rebuilt prompt"):
        ar.recorded_texts(runs, "c", tok)


def test_an_online_replay_learns_the_curve_it_is_priced_by(ar):
    """replay.py's CurveClock: each pass of an online controller's replay takes its price
    on the curve, so the plain step it learns is 1 unit (the prior below says 2; real
    time: microseconds), and the text is reproduced (replay_cost asserts it) with its
    restated part drafted."""
    replay = sys.modules["replay"]  # imported by agent_replay
    rng = random.Random(0)
    source = [rng.randrange(1, 400) for _ in range(300)]
    prior = CostModel({b: 2 * c for b, c in STEEP.verify.items()})  # step_seconds 2
    controller = replay.shipped_controller(prior, [ar.NgramDrafter(max_n=ar.NGRAM_MAX)],
                                           online=True)
    steps = replay.replay_cost(source, source[:200], None, None, STEEP, ar.K, VOCAB, EOS,
                               controller)
    assert 200 / steps > 1.5  # the restated text is drafted
    assert controller.costs.plain_seconds(len(source) + 200) == pytest.approx(1.0)
