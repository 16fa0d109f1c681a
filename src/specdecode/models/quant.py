"""Weight-only int8 for draft models: half the bytes per token on a memory-bound CPU.

A drafter's precision never changes the output (the verifier checks every
draft token against the target), only how often drafts are accepted; so a
draft model can run in int8 while the target stays in bf16/fp32. Per output
channel symmetric scales; on CPU the matmul is PyTorch's fused
`_weight_int8pack_mm` (int8 weights, bf16/fp16 activations). That kernel's
cost grows linearly with the number of rows (measured on a 2-core Xeon, a
896x4864 layer in bf16: 0.3 ms for 1-4 rows, 18 ms for 256, where
dequantizing and a dense matmul take 6 ms), so batches of more than
PACKED_MAX_ROWS rows (a draft model's prefill) and fp32 activations (slower
through it at every size) take the dequantize path; on a CPU without bf16
matrix hardware, passes of wide_f32.WIDE_ROWS rows or more multiply in float32
through wide_f32.product instead (see wide_f32.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models import wide_f32
from specdecode.models.arena import move_to_arena

PACKED_MAX_ROWS = 16


def worth_it(device: str | torch.device, dtype: str | torch.dtype) -> bool:
    """Whether "auto" draft quantisation picks int8: on CPU with bf16/fp16 activations."""
    return str(device).startswith("cpu") and str(dtype).removeprefix("torch.") in (
        "bfloat16", "float16")


class Int8Linear(nn.Module):
    """y = x @ (int8 weight * per-row scale).T, bias-free or with a float bias."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
        self.register_buffer("weight_int8", (w / scale[:, None]).round().clamp(-127, 127)
                             .to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.wide_f32 = wide_f32.wanted(w.device, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        packed = flat.shape[0] <= PACKED_MAX_ROWS and x.dtype != torch.float32
        if flat.device.type == "cpu" and packed:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale.to(x.dtype))
        elif self.wide_f32 and wide_f32.applies(flat, flat.shape[0]):
            return wide_f32.product(flat, self.weight_int8, self.bias, self.scale).reshape(
                *x.shape[:-1], self.out_features)
        else:
            y = F.linear(flat, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in `model` (lm_head included) by an Int8Linear, in place;
    on CPU the result is moved into one huge-page arena (see arena.py)."""
    _replace_linears(model)
    move_to_arena(model)
    return model


def _replace_linears(model: nn.Module) -> None:
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            _replace_linears(child)
