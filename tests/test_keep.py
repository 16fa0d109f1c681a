"""CausalLM.keep: compacting the cache to the accepted branch of a token tree equals a
fresh prefill of the kept sequence (float32 torch; the llama.cpp case is in
test_llama_cpp_sequences.py)."""

from __future__ import annotations

import pytest
import torch

import real
from conftest import tiny

PREFIX = torch.tensor([5, 9, 200, 31, 7, 77, 3])
# A tree below the prefix, in topological order: node, parent (-1: the prefix), token.
#   0:a (depth 0) -> 1:b (1) -> 3:d (2)      2:c (depth 1, child of 0)    4:e (depth 0)
PARENTS = [-1, 0, 0, 1, -1]
TOKENS = torch.tensor([11, 12, 13, 14, 15])


def tree_inputs(parents: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 (start + depth) and tree_mask [T, T] bool (ancestors + self)."""
    t = len(parents)
    mask = torch.zeros(t, t, dtype=torch.bool)
    depth = [0] * t
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return start + torch.tensor(depth), mask


def check_keep_equals_fresh(model, fresh, path: list[int], next_token: int, rel: float
                            ) -> float:
    """Tree forward + keep(path) on `model`, then one token; the same on `fresh` by a plain
    prefill of prefix + the path's tokens. Returns the max |logit difference|, asserted
    <= rel * the largest |logit| (and the same argmax)."""
    model.prefill(PREFIX)
    p = len(PREFIX)
    positions, mask = tree_inputs(PARENTS, p)
    model.forward(TOKENS, positions=positions, tree_mask=mask)
    model.keep([p + i for i in path], start=p)
    assert model.cached_len == p + len(path)
    got = model.forward(torch.tensor([next_token])).logits
    fresh.prefill(torch.cat((PREFIX, TOKENS[path])))
    want = fresh.forward(torch.tensor([next_token])).logits
    diff = float((got - want).abs().max())
    assert diff <= rel * float(want.abs().max()), f"max |difference| {diff}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    return diff


@pytest.mark.parametrize("path", [[0, 1, 3], [0, 2], [4], [0]])
def test_keep_tree_branch_tiny(path):
    check_keep_equals_fresh(tiny(1), tiny(1), path, 42, 1e-6)


def test_keep_tree_branch_real_float32():
    """The kept keys/values come from a 5-token tree pass, the fresh ones from a prompt
    pass: measured up to 4e-5 on logits up to 30 (as any two pass shapes differ), asserted
    within 1e-5 of the scale."""
    model = real.load("smollm2-135m").model
    fresh = model.sequence(1)  # the same weights, a cache of its own
    for path in ([0, 1, 3], [0, 2], [4]):
        check_keep_equals_fresh(model, fresh, path, 42, 1e-5)


def test_keep_with_start_and_validation():
    model = tiny(1)
    model.prefill(PREFIX)
    model.keep([], start=4)  # nothing of the rest: a rollback
    assert model.cached_len == 4
    model.keep([1, 3])  # the prefix before index 1, plus 1 and 3
    assert model.cached_len == 3
    for bad in ([2, 1], [0, 5], [1, 1]):
        with pytest.raises(ValueError, match="keep"):
            model.keep(bad)
    with pytest.raises(ValueError, match="keep"):
        model.keep([])
    with pytest.raises(ValueError, match="keep"):
        model.keep([0], start=1)
    assert model.cached_len == 3
