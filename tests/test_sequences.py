"""Sequence handles: model.sequence(i) is an independent CausalLM on the same weights, and
forward_many runs the tokens of several sequences in one pass with the logits each gets
alone (float32 torch; the llama.cpp case is in test_llama_cpp_sequences.py)."""

from __future__ import annotations

import pytest
import torch

import real
from conftest import tiny
from specdecode.models import CausalLM

A = torch.tensor([5, 9, 200, 31, 7, 77, 3, 150, 42, 8, 19])
B = torch.tensor([17, 4, 99, 250, 61])


def alone(model, prompt: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab] of the prompt's pass and of a following step, on a fresh cache."""
    first = model.forward(prompt).logits
    return first, model.forward(step).logits


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> float:  # [T, vocab] each
    """Max |difference|, asserted <= rel * the largest |logit| (and the same argmax)."""
    diff = float((got - want).abs().max())
    assert diff <= rel * float(want.abs().max()), f"max |difference| {diff}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    return diff


def check_two_in_one_pass(model, rel: float) -> float:
    """Two sequences (different prompts and lengths) through forward_many, twice (prompts,
    then a 3- and a 1-token step), against each run alone. Returns the max |difference|.
    Prompts too are compared within rounding: the same rows through a GEMM of more rows
    were bit-identical with 1 torch thread here, not with 2 (the blocking differs)."""
    s0, s1 = model, model.sequence(1)
    s0.rollback(0)
    s1.rollback(0)
    steps = (torch.tensor([1, 2, 3]), torch.tensor([7]))
    want = [alone(s0, A, steps[0]), alone(s1, B, steps[1])]
    s0.rollback(0)
    s1.rollback(0)
    firsts = model.forward_many([(s0, A), (s1, B)])
    seconds = model.forward_many([(s1, steps[1]), (s0, steps[0])])[::-1]
    assert (s0.cached_len, s1.cached_len) == (len(A) + 3, len(B) + 1)
    diff = 0.0
    for (w_first, w_second), first, second in zip(want, firsts, seconds):
        diff = max(diff, close(first.logits, w_first, rel), close(second.logits, w_second, rel))
    return diff


def test_two_sequences_in_one_pass_tiny():
    check_two_in_one_pass(tiny(1), 1e-5)


def test_two_sequences_in_one_pass_real_float32():
    """Prompts run at their buckets, as alone (within rounding, see above). The steps run
    as a 4-row pass instead of a 3-row and a 1-row one: measured up to 6.5e-5 on logits up to
    35 (2e-6 of the scale; a 3-token pass against three 1-token passes of one sequence
    differs as much), asserted within 1e-5 of the scale."""
    check_two_in_one_pass(real.load("smollm2-135m").model, 1e-5)


def test_handles_are_independent_causal_lms():
    model = tiny(2)
    s1 = model.sequence(1)
    assert isinstance(s1, CausalLM) and model.sequence(1) is s1 and model.sequence(0) is model
    model.prefill(A)
    s1.prefill(B)
    assert (model.cached_len, s1.cached_len) == (len(A), len(B))
    s1.rollback(2)
    assert model.cached_len == len(A)
    got = s1.forward(A[:3]).logits
    want = tiny(2).forward(torch.cat((B[:2], A[:3]))).logits[-3:]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    last = model.forward(torch.tensor([4])).logits  # sequence 0 untouched by sequence 1
    fresh = tiny(2)
    fresh.prefill(A)
    torch.testing.assert_close(last, fresh.forward(torch.tensor([4])).logits,
                               atol=1e-5, rtol=1e-5)


def test_hidden_layers_and_last_n_in_forward_many():
    model = tiny(1)
    s1 = model.sequence(1)
    outs = model.forward_many([(model, A), (s1, B)], last_n=2, hidden_layers=(0, -1))
    assert [o.logits.shape[0] for o in outs] == [2, 2]
    assert all(set(o.hidden_states) == {0, -1} for o in outs)
    solo = tiny(1).forward(B, last_n=2, hidden_layers=(0,))
    torch.testing.assert_close(outs[1].hidden_states[0], solo.hidden_states[0],
                               atol=1e-5, rtol=1e-5)


def test_lazy_allocation_and_errors():
    model = tiny(1)
    assert model._sequences == {}  # nothing allocated for sequences never opened
    with pytest.raises(ValueError, match="once"):
        model.forward_many([(model, A), (model, B)])
    with pytest.raises(ValueError, match="sequence of this model"):
        model.forward_many([(tiny(1), A)])
    with pytest.raises(ValueError, match="context limit"):
        model.forward_many([(model.sequence(1), torch.zeros(model.max_seq_len + 1,
                                                             dtype=torch.long))])
