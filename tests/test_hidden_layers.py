"""CausalLM.forward(hidden_layers=...): decoder-layer outputs and the final norm's output."""

from __future__ import annotations

import pytest
import torch

import real
from conftest import tiny
from specdecode.models.base import FINAL_LAYER, ForwardOutput

IDS = torch.tensor([5, 9, 200, 31, 7, 77, 3, 150, 42, 8])


def _layer_outputs(model, ids: torch.Tensor) -> list[torch.Tensor]:  # ids: [T]
    """Each decoder layer's output [T, hidden], caught by forward hooks on a fresh pass."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(out[0].clone()))
             for layer in model.layers]
    try:
        model.prefill(ids)  # no padding: ids is 16 tokens long (a prefill bucket)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_layers_are_decoder_outputs_and_final_is_post_norm():
    model = tiny(1)
    ids = torch.arange(16) * 7 % 250
    caught = _layer_outputs(model, ids)
    n_layers = len(model.layers)
    out = model.prefill(ids, hidden_layers=(0, n_layers - 1, FINAL_LAYER))
    assert set(out.hidden_states) == {0, n_layers - 1, FINAL_LAYER}
    torch.testing.assert_close(out.hidden_states[0], caught[0][-1:], rtol=0, atol=0)
    torch.testing.assert_close(out.hidden_states[n_layers - 1], caught[-1][-1:], rtol=0, atol=0)
    final = model.norm(out.hidden_states[n_layers - 1])
    torch.testing.assert_close(out.hidden_states[FINAL_LAYER], final)
    assert out.hidden is out.hidden_states[FINAL_LAYER]


def test_same_positions_as_logits_and_return_hidden_shorthand():
    model = tiny(1)
    model.prefill(IDS[:4])
    out = model.forward(IDS[4:], last_n=3, hidden_layers=(1,), return_hidden=True)
    assert out.logits.shape[0] == 3
    assert out.hidden_states[1].shape == (3, model.config.hidden_size)
    assert out.hidden.shape == (3, model.config.hidden_size)
    model.rollback(4)
    full = model.forward(IDS[4:], hidden_layers=(1,))
    assert full.hidden is None and set(full.hidden_states) == {1}
    torch.testing.assert_close(out.hidden_states[1], full.hidden_states[1][-3:])
    torch.testing.assert_close(out.logits, full.logits[-3:])


def test_unknown_layer_is_a_clear_error():
    model = tiny(1)
    with pytest.raises(ValueError, match="hidden layer 7 does not exist"):
        model.forward(IDS, hidden_layers=(7,))
    assert model.cached_len == 0


def test_forward_output_fields_fill_each_other():
    h = torch.ones(2, 4)
    assert ForwardOutput(torch.zeros(2, 3), h).hidden_states == {FINAL_LAYER: h}
    assert ForwardOutput(torch.zeros(2, 3), hidden_states={FINAL_LAYER: h}).hidden is h
    assert ForwardOutput(torch.zeros(2, 3)).hidden is None


def test_real_model_layers_float32():
    """SmolLM2-135M in float32: the last layer's output, normed, is the final state."""
    model = real.load("smollm2-135m").model
    n = len(model.layers)
    out = model.prefill(IDS, hidden_layers=(2, n // 2, n - 3, n - 1, FINAL_LAYER))
    assert all(h.shape == (1, model.config.hidden_size) for h in out.hidden_states.values())
    torch.testing.assert_close(model.norm(out.hidden_states[n - 1]), out.hidden, rtol=0, atol=0)
    plain = model.prefill(IDS)
    assert torch.equal(plain.logits, out.logits)
