"""Int8 weight-only draft layers: both kernels (packed for few rows, dequantize for many)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdecode.models.quant import PACKED_MAX_ROWS, Int8Linear, quantize_int8, worth_it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 200])
def test_int8_linear_equals_its_dequantized_weights(dtype, rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    q = Int8Linear(linear)
    x = torch.randn(rows, 64, dtype=dtype)
    dense = q.weight_int8.float() * q.scale.float()[:, None]  # [out, in]
    ref = x.float() @ dense.T + linear.bias.float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(q(x).float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    # and int8 stays close to the original layer (per-row scales, 8 bits)
    err = (q(x).float() - linear(x).float()).abs().max() / linear(x).float().abs().max()
    assert err < 0.03


def test_quantize_int8_replaces_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)))
    quantize_int8(model)
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][0], Int8Linear)
    assert model(torch.randn(3, 8)).shape == (3, 4)


def test_auto_quantisation_only_where_it_pays():
    assert worth_it("cpu", "bfloat16") and worth_it("cpu", torch.float16)
    assert not worth_it("cpu", "float32") and not worth_it("cuda", "bfloat16")
