"""The llama.cpp backend's sequence handles, tree passes + keep, and hidden-layer errors.

Needs the llama.cpp build (skipped without it outside CI, as test_llama_cpp.py).
Measured on SmolLM2-135M Q4_1 (2 threads): every comparison here is bit-identical,
so each asserts equality (a max |difference| of 0).
"""

from __future__ import annotations

import os

import pytest
import torch

import real
from specdecode.models import llama_cpp
from test_keep import PARENTS, PREFIX, TOKENS, check_keep_equals_fresh, tree_inputs
from test_sequences import check_two_in_one_pass

if not llama_cpp.available():
    if os.environ.get("CI"):
        raise RuntimeError("CI must test the llama.cpp backend: run specdecode build-llama-cpp")
    pytest.skip("llama.cpp is not built (specdecode build-llama-cpp)", allow_module_level=True)
from specdecode.models.llama_cpp import LlamaCppLM  # noqa: E402


def smol() -> LlamaCppLM:
    return LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2)


def test_keep_tree_branch_equals_fresh_prefill():
    """A tree pass (one branch id per leaf) then keep(path) (the path decoded again as a
    chain), against a plain prefill of prefix + path in another context: bit-identical."""
    model, fresh = smol(), smol()
    for path in ([0, 1, 3], [0, 2], [4], [0], []):
        assert check_keep_equals_fresh(model, fresh, path, 42, 0.0) == 0.0
        assert len(model._free_branch_ids) == 56  # every branch id back


def test_rollback_inside_a_tree_and_keep_errors():
    model = smol()
    model.prefill(PREFIX)
    positions, mask = tree_inputs(PARENTS, len(PREFIX))
    model.forward(TOKENS, positions=positions, tree_mask=mask)
    with pytest.raises(ValueError, match="tree pass"):
        model.forward(torch.tensor([1]))
    with pytest.raises(ValueError, match="path from a root"):
        model.keep([len(PREFIX) + 1], start=len(PREFIX))  # depth 1 without its parent
    model.rollback(len(PREFIX))
    assert model.cached_len == len(PREFIX) and len(model._free_branch_ids) == 56
    with pytest.raises(ValueError, match="contiguous"):
        model.keep([1, 3])  # a chain's tokens cannot move positions
    model.keep([2, 3, 4])
    assert model.cached_len == 5


def test_two_sequences_in_one_pass():
    """Sequence 1 opened (the context rebuilt multi-sequence, sequence 0 moved over); the
    two prompts and steps in one llama_batch against each alone: bit-identical."""
    assert check_two_in_one_pass(smol(), 0.0) == 0.0


def test_tree_rows_equal_their_chains():
    """Each node of a tree pass gets the logits of its root path run as a chain."""
    model, chain = smol(), smol()
    model.prefill(PREFIX)
    positions, mask = tree_inputs(PARENTS, len(PREFIX))
    rows = model.forward(TOKENS, positions=positions, tree_mask=mask).logits
    for i in range(len(TOKENS)):
        chain.prefill(PREFIX)
        want = chain.forward(TOKENS[mask[i]]).logits[-1]
        assert torch.equal(rows[i], want)


def test_only_the_final_hidden_layer():
    model = smol()
    out = model.prefill(PREFIX, hidden_layers=(-1,))
    assert out.hidden.shape == (1, model.hidden_size)
    with pytest.raises(ValueError, match="only the final hidden state"):
        model.forward(torch.tensor([1]), hidden_layers=(2,))
    assert model.cached_len == len(PREFIX)

