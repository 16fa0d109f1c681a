"""`specdecode check`: each check passes on a correct engine and fails on a broken one.

Negative controls: a verifier that always accepts (the distribution check must fail
it, for drafts with q and for point masses), a greedy verifier that keeps every
draft token (the greedy check must call it "not a tie: BUG"); bad options exit 2
before any model is loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import real
from specdecode.check.chisquare import chi_square_pvalue
from specdecode.check.distribution import ALPHA, CONFIRM, Capture, _row, draw, judge
from specdecode.check.near_tie import classify, threshold
from specdecode.options import LoadSpec
from specdecode.sampling import SamplingParams, sample
from specdecode.verify import GreedyVerifier, SamplingVerifier, VerifyResult
from test_cli import assert_clean_error

V = 40
PARAMS = SamplingParams(temperature=1.0)


class AlwaysAccept:
    """A broken rule (the negative control): keeps every draft token, then samples p."""

    def __init__(self, params, key, generator) -> None:
        self.generator = generator

    def verify_probs(self, draft_tokens, q, p, start) -> VerifyResult:  # [k], [k, V], [k+1, V]
        k = draft_tokens.shape[0]
        kept = tuple(int(t) for t in draft_tokens.tolist())
        bonus = sample(p[k], self.generator)
        return VerifyResult(k, bonus, kept + (bonus,))


def _capture(with_q: bool, seed: int = 0) -> Capture:
    g = torch.Generator().manual_seed(seed)
    p0, p1 = (torch.softmax(2 * torch.randn(V, generator=g), 0) for _ in range(2))
    q = torch.softmax(p0.log() + torch.randn(V, generator=g), 0)  # a draft near p0
    d = int((q if with_q else p0).argmax())
    return Capture("synthetic", 10, p0, q if with_q else None, d, p1)


def test_chi_square_accepts_its_law_and_rejects_another():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V, generator=g), 0)
    counts = torch.bincount(torch.multinomial(p, 20000, True, generator=g), minlength=V)
    assert chi_square_pvalue(counts, p) > 1e-3
    other = torch.softmax(torch.randn(V, generator=g), 0)
    assert chi_square_pvalue(counts, other) < 1e-6
    forbidden = p.clone()
    forbidden[int(counts.argmax())] = 0
    assert chi_square_pvalue(counts, forbidden) == 0.0


def test_near_tie_classification():
    assert classify(None, 0.5) == "identical"
    assert classify({"top2_margin": 0.1}, 0.5) == "near-tie (backend rounding)"
    assert classify({"top2_margin": 0.1}, 0.0) == "not a tie: BUG"
    assert classify({"top2_margin": None}, 0.5) == "not a tie: BUG"
    assert threshold("torch", "float32") == 0.0
    assert threshold("torch", "bfloat16") == 0.5
    assert threshold("llama.cpp", "float32") == 1.0  # bench/results/flash-attn-zen5.md


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-q", "point-mass"])
def test_distribution_passes_the_verifier_and_fails_always_accept(with_q):
    c = _capture(with_q)
    good = _row(c, draw(c, PARAMS, 6000, seed=3), "real")
    assert good.passed, good.detail
    assert good.data["bonus_draws"] >= 20 and good.data["p_bonus"] is not None
    bad = _row(c, draw(c, PARAMS, 6000, seed=3, verifier=AlwaysAccept), "broken")
    assert not bad.passed, bad.detail


class BrokenFirst:
    """Always-accept for the first `n` requests, then the real rule: a first try that
    fails and a second that passes, as a chance failure of a correct rule would."""

    def __init__(self, n: int) -> None:
        self.left = n

    def __call__(self, params, key, generator):
        self.left -= 1
        rule = AlwaysAccept if self.left >= 0 else SamplingVerifier
        return rule(params, key, generator)


def test_a_case_below_alpha_is_drawn_again_and_a_broken_rule_fails_both_tries():
    c = _capture(True)
    chance = judge(c, PARAMS, 3000, 3, "chance", BrokenFirst(3000))
    assert chance.passed, chance.detail
    assert chance.data["first_try"]["p_first"] < ALPHA, chance.detail
    assert chance.data["draws"] == CONFIRM * 3000 and "drawn again" in chance.detail
    broken = judge(c, PARAMS, 3000, 3, "broken", AlwaysAccept)
    assert not broken.passed and broken.data["first_try"]["draws"] == 3000, broken.detail
    good = judge(c, PARAMS, 3000, 3, "real")
    assert good.passed and "first_try" not in good.data, good.detail


# -- on a real model (SmolLM2-135M, float32 torch: any divergence is a bug) ----------

@pytest.fixture(scope="module")
def pair():
    from specdecode.check.pair import Pair

    spec = LoadSpec(target=str(real.path("smollm2-135m")), backend="torch", dtype="float32",
                    max_seq_len=1024)
    pair = Pair.load(spec)
    assert pair.limit == 0.0 and pair.drafters
    return pair


@pytest.fixture(scope="module")
def prompts(pair):
    return pair.prompts(["humaneval", "chat"], 1)


def test_greedy_identity_and_its_negative_control(pair, prompts, monkeypatch):
    from specdecode.check.greedy import check_greedy

    rows = check_greedy(pair, prompts, [1, 3], 24)
    assert [r.case for r in rows] == [f"{d} k={k}" for d in pair.drafters for k in (1, 3)]
    assert all(r.passed and r.data["identical"] == 2 for r in rows), [r.detail for r in rows]
    assert sum(r.data["accepted"] for r in rows) > 0

    def keep_all(self, draft_tokens, q, logits, start):  # [k], -, [k + 1, V]
        k = draft_tokens.shape[0]
        bonus = int(logits[k].argmax())
        return VerifyResult(k, bonus, tuple(draft_tokens.tolist()) + (bonus,))

    monkeypatch.setattr(GreedyVerifier, "verify", keep_all)
    broken = check_greedy(pair, prompts, [3], 24)
    assert not any(r.passed for r in broken)
    bug = broken[0].data["divergences"][0]
    assert bug["verdict"] == "not a tie: BUG" and bug["top2_margin"] > 0


def test_distribution_on_captured_tensors(pair, prompts):
    from specdecode.check.distribution import SETTINGS, check_distribution

    rows = check_distribution(pair, prompts, 1500)
    assert len(rows) == len(SETTINGS)  # no draft model: point mass only
    assert all(r.passed for r in rows), [r.detail for r in rows]
    assert all(r.data["bonus_draws"] >= 20 for r in rows), [r.detail for r in rows]
    broken = check_distribution(pair, prompts, 1500, verifier=AlwaysAccept)
    assert not any(r.passed for r in broken), [r.detail for r in broken]


def test_stops_inside_drafts(pair, prompts):
    from specdecode.check.stops import check_stops

    rows = check_stops(pair, prompts, [4], 32)
    cases = " | ".join(r.case for r in rows)
    assert "max_tokens mid-draft" in cases and "end token inside a draft" in cases
    assert "spanning tokens" in cases
    assert all(r.passed and not r.data["differ"] for r in rows), [r.detail for r in rows]
    assert {r.data["speculative"]["finish_reason"] for r in rows} == {"length", "stop"}


def test_fallback_completes_with_plain_output(pair, prompts):
    """The output half of the fallback check (its speed half is a measurement: the
    row's ratio, reported, not asserted here)."""
    from specdecode.check.fallback import check_fallback

    (row,) = check_fallback(pair, prompts, 24)
    assert row.data["verdicts"] == ["identical"] * len(prompts)
    assert row.data["drafted"] > 0
    assert row.data["median_ratio"] > 0


def test_cli_json_and_exit_status():
    proc = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "check", "--target",
         str(real.path("smollm2-135m")), "--backend", "torch", "--dtype", "float32",
         "--checks", "stops", "--prompts", "1", "-n", "16", "--json", "-"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "near-tie threshold 0.0" in report["title"]
    assert report["rows"] and all(r["passed"] for r in report["rows"])


@pytest.mark.parametrize("args, needles", [
    (["check", "--checks", "speed"], ["--checks", "speed"]),
    (["check", "-w", "no-such-workload"], ["no-such-workload"]),
    (["check", "--ks", "0"], ["--ks"]),
    (["check", "--target", "/no/such/model.gguf"], ["no such model file"]),
])
def test_cli_bad_options(args, needles):
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", *args],
                          capture_output=True, text=True, timeout=120)
    assert_clean_error(proc, *needles)
