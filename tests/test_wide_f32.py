"""models/wide_f32.py: bf16 weights multiplied in float32 for wide passes.

The path runs only on CPUs without bf16 matrix hardware, so these tests force
it (SPECDECODE_WIDE_F32) to check it on every machine kind. Each test also
counts the calls to wide_f32.product: on some data PyTorch's own bf16 product
rounds to the very same values, so outputs alone cannot show which path ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode import memory
from specdecode.models import wide_f32
from specdecode.models.config import ModelConfig
from specdecode.models.loading import build
from specdecode.models.quant import Int8Linear
from specdecode.models.transformer import Transformer


@pytest.fixture
def calls(monkeypatch) -> list:
    """The shapes of the inputs wide_f32.product was called with."""
    seen, real = [], wide_f32.product
    monkeypatch.setattr(wide_f32, "product", lambda x, *a: seen.append(x.shape) or real(x, *a))
    return seen


def _linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16)
    wide_f32.install(layer)
    return layer


def _float32_product(x, layer) -> torch.Tensor:  # rounded once to bf16
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.weight.float(), bias).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scratch,row_block", [(wide_f32.SCRATCH_ELEMENTS, 512),
                                               (1024 * 7, 16)])  # one block; blocks both ways
def test_a_wide_pass_is_the_float32_product_rounded_once(monkeypatch, calls, bias, scratch,
                                                         row_block):
    monkeypatch.setattr(wide_f32, "SCRATCH_ELEMENTS", scratch)
    monkeypatch.setattr(wide_f32, "ROW_BLOCK", row_block)
    monkeypatch.setitem(wide_f32._scratch, "buffer", None)  # sized to SCRATCH_ELEMENTS
    layer = _linear(1024, 200, bias)
    x = torch.randn(2, wide_f32.WIDE_ROWS, 1024).to(torch.bfloat16)  # [2, rows, in]
    expected = _float32_product(x, layer)
    assert not torch.equal(F.linear(x, layer.weight, layer.bias), expected)  # tells them apart
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, wide_f32.WIDE_ROWS, 200)
    assert calls == [(2 * wide_f32.WIDE_ROWS, 1024)]
    if row_block == 512:  # one product: the same float32 sums
        assert torch.equal(got, expected)
    else:  # blocks of other shapes sum in another order: within bf16 rounding
        assert torch.allclose(got.float(), expected.float(), rtol=2 ** -7, atol=1e-3)


def test_narrow_float32_and_autograd_passes_keep_the_plain_product(calls):
    layer = _linear(64, 200, True)
    narrow = torch.randn(wide_f32.WIDE_ROWS - 1, 64).to(torch.bfloat16)  # [rows, in]
    wide = torch.randn(wide_f32.WIDE_ROWS * 2, 64).to(torch.bfloat16)  # [rows, in]
    with torch.inference_mode():
        assert torch.equal(layer(narrow), F.linear(narrow, layer.weight, layer.bias))
        assert layer.float()(wide.float()).dtype == torch.float32
    layer.to(torch.bfloat16)
    layer(wide).sum().backward()  # autograd on: the plain product, gradients as nn.Linear's
    assert layer.weight.grad is not None
    assert calls == []


def test_int8_layers_take_the_float32_product_for_wide_passes(monkeypatch, calls):
    monkeypatch.setenv("SPECDECODE_WIDE_F32", "1")
    torch.manual_seed(0)
    quantized = Int8Linear(nn.Linear(64, 96, bias=True).to(torch.bfloat16))
    assert quantized.wide_f32
    x = torch.randn(40, 64).to(torch.bfloat16)  # [rows, in]: more than PACKED_MAX_ROWS
    expected = (F.linear(x.float(), quantized.weight_int8.float()) * quantized.scale.float()
                + quantized.bias.float()).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(quantized(x), expected)
    assert calls == [(40, 64)]


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


def test_a_bf16_prefill_runs_through_it_and_stays_near_float32(monkeypatch, calls):
    """A whole model's wide prefill (40 tokens, run as 48 rows): forced on, its seven
    projections per layer go through wide_f32.product (forced off, none do), and both
    stay near the float32 model with the same greedy token on this seed."""
    cfg = _config()
    state = Transformer.random(cfg, seed=1).state_dict()
    ids = torch.randint(0, cfg.vocab_size, (40,))  # [40] int64
    logits = {}
    for forced in ("1", "0"):
        monkeypatch.setenv("SPECDECODE_WIDE_F32", forced)
        model = build(cfg, state, dtype=torch.bfloat16, device="cpu", max_seq_len=64)
        before = len(calls)
        logits[forced] = model.prefill(ids).logits  # [1, vocab]
        # the lm_head reads the last row only: narrow
        assert len(calls) - before == (7 * cfg.num_layers if forced == "1" else 0)
    expected = Transformer.random(cfg, seed=1).float().prefill(ids).logits
    assert logits["1"].argmax() == expected.argmax() == logits["0"].argmax()
    assert (logits["1"] - expected).abs().max() < 0.5


@pytest.mark.parametrize("forced", ["1", "0"])
def test_the_memory_plan_counts_the_scratch_buffer(monkeypatch, forced):
    monkeypatch.setenv("SPECDECODE_WIDE_F32", forced)
    cfg = _config()
    spec = type("Spec", (), {"dtype": "bfloat16", "device": "cpu"})()
    part = memory._activations("torch", cfg, spec, context=64, k=4, drafted=False)
    monkeypatch.setenv("SPECDECODE_WIDE_F32", "0")
    plain = memory._activations("torch", cfg, spec, context=64, k=4, drafted=False)
    assert part.bytes - plain.bytes == (wide_f32.SCRATCH_BYTES if forced == "1" else 0)
