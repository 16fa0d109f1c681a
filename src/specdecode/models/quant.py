"""Weight-only int8 for draft models: half the bytes per token on a memory-bound CPU.

A drafter's precision never changes the output (the verifier checks every
draft token against the target), only how often drafts are accepted; so a
draft model can run in int8 while the target stays in bf16/fp32. Per output
channel symmetric scales; on CPU the matmul is PyTorch's fused
`_weight_int8pack_mm` (int8 weights, bf16/fp32 activations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale.to(x.dtype))
        else:
            y = F.linear(flat, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in `model` (lm_head included) by an Int8Linear, in place."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model
