"""The report's last line: where a greedy output parts from plain decoding, the target's
top-2 margin there and whether that is the backend's near-tie (report.divergence)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import real
from specdecode.llm import LLM
from specdecode.report import _same_line, divergence
from specdecode.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM.load(str(real.path("smollm2-135m")), backend="torch", dtype="float32",
                    drafter="ngram", k=3, max_seq_len=256)


def test_a_divergence_is_located_and_judged_by_the_backend_threshold(llm):
    ids = llm.encode("Name three colours.", chat=True)
    plain = llm.generate(ids, GREEDY, speculative=False)
    assert divergence(llm, ids, GREEDY, plain, plain) is None
    logits = llm.target.prefill(torch.tensor(ids + plain.token_ids[:3])).logits
    second = int(logits[-1].topk(2).indices[1])
    parted = replace(plain, token_ids=plain.token_ids[:3] + [second])
    found = divergence(llm, ids, GREEDY, parted, plain)
    assert found["index"] == 3 and found["other_token"] == second
    assert found["top2_margin"] > 0 and found["threshold"] == 0.0  # float32: any is a bug
    assert found["verdict"] == "not a tie: BUG"
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    assert divergence(llm, ids, sampled, parted, plain) is None  # tokens not promised


def test_the_last_line_says_which_kind_of_divergence():
    base = {"speedup": 1.5, "identical_to_plain": False}
    tie = {"index": 7, "top2_margin": 0.069, "threshold": 0.5,
           "verdict": "near-tie (backend rounding)"}
    bug = {**tie, "top2_margin": 3.2, "verdict": "not a tie: BUG"}
    assert "identical to plain" in _same_line({**base, "identical_to_plain": True}, "torch")
    assert "DIFFERENT" in _same_line({**base, "divergence": None}, "torch")
    line = _same_line({**base, "divergence": tie}, "llama.cpp")
    assert "from token 7 on" in line and "0.069" in line and "a near-tie" in line
    assert "NOT a near-tie" in _same_line({**base, "divergence": bug}, "llama.cpp")
