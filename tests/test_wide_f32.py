"""models/wide_f32.py: bf16 weights multiplied in float32 for wide passes.

The path runs only on CPUs without bf16 matrix hardware, so these tests force
it (SPECDECODE_WIDE_F32) to check it on every machine kind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models import wide_f32
from specdecode.models.config import ModelConfig
from specdecode.models.loading import build
from specdecode.models.quant import Int8Linear
from specdecode.models.transformer import Transformer


def _linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
    wide_f32.install(layer)
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scratch", [wide_f32.SCRATCH_ELEMENTS, 64 * 7])  # one block; blocks
def test_a_wide_pass_is_the_float32_product_rounded_once(monkeypatch, bias, scratch):
    monkeypatch.setattr(wide_f32, "SCRATCH_ELEMENTS", scratch)
    layer = _linear(64, 200, bias)
    x = torch.randn(2, wide_f32.WIDE_ROWS, 64).to(torch.bfloat16)  # [2, rows, in]
    expected = F.linear(x.float(), layer.weight.float(),
                        None if layer.bias is None else layer.bias.float()).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, wide_f32.WIDE_ROWS, 200)
    assert torch.equal(got, expected)


def test_a_narrow_pass_is_pytorchs_own_bf16_product():
    layer = _linear(64, 200, True)
    x = torch.randn(wide_f32.WIDE_ROWS - 1, 64).to(torch.bfloat16)  # [rows, in]
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_float32_layers_are_untouched():
    layer = _linear(64, 200, True).float()
    x = torch.randn(wide_f32.WIDE_ROWS * 2, 64)  # [rows, in]
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_int8_layers_take_the_float32_product_for_wide_passes(monkeypatch):
    monkeypatch.setenv("SPECDECODE_WIDE_F32", "1")
    torch.manual_seed(0)
    quantized = Int8Linear(nn.Linear(64, 96, bias=False).to(torch.bfloat16))
    assert quantized.wide_f32
    x = torch.randn(40, 64).to(torch.bfloat16)  # [rows, in]: more than PACKED_MAX_ROWS
    expected = (F.linear(x.float(), quantized.weight_int8.float())
                * quantized.scale.float()).to(torch.bfloat16)
    assert torch.equal(quantized(x), expected)


def _config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=128, tie_word_embeddings=True)


@pytest.mark.parametrize("forced,dtype,expected", [
    ("1", torch.bfloat16, True), ("0", torch.bfloat16, False), ("1", torch.float32, False)])
def test_the_loader_installs_it_where_wanted(monkeypatch, forced, dtype, expected):
    monkeypatch.setenv("SPECDECODE_WIDE_F32", forced)
    cfg = _config()
    state = Transformer.random(cfg, seed=0).state_dict()
    model = build(cfg, state, dtype=dtype, device="cpu", max_seq_len=64)
    kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    assert kinds == ({wide_f32.WideF32Linear} if expected else {nn.Linear})
    assert set(model.state_dict()) == set(state)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied


def test_a_bf16_prefill_runs_through_it_and_stays_near_float32(monkeypatch):
    """A whole model's wide prefill (40 tokens, run as 48 rows): forced on, its products
    go through wide_f32.product (forced off, none do), and both stay near the float32
    model with the same greedy token on this seed."""
    calls = []
    real = wide_f32.product
    monkeypatch.setattr(wide_f32, "product", lambda *a: calls.append(a[0].shape) or real(*a))
    cfg = _config()
    state = Transformer.random(cfg, seed=1).state_dict()
    ids = torch.randint(0, cfg.vocab_size, (40,))  # [40] int64
    logits = {}
    for forced in ("1", "0"):
        monkeypatch.setenv("SPECDECODE_WIDE_F32", forced)
        model = build(cfg, state, dtype=torch.bfloat16, device="cpu", max_seq_len=64)
        before = len(calls)
        logits[forced] = model.prefill(ids).logits  # [1, vocab]
        # 7 projections per layer at 48 rows; the lm_head reads the last row only
        assert len(calls) - before == (7 * cfg.num_layers if forced == "1" else 0)
    reference = Transformer.random(cfg, seed=1).float()
    expected = reference.prefill(ids).logits
    assert logits["1"].argmax() == expected.argmax() == logits["0"].argmax()
    assert (logits["1"] - expected).abs().max() < 0.5
