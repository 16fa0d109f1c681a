"""bf16 weights, float32 products for wide passes on CPUs without bf16 matrix hardware.

On a CPU with neither AVX512-BF16 nor AMX (AMD Zen 3, Intel before Cooper Lake),
PyTorch's bf16 matrix product has no hardware path and is compute-bound far
below float32: measured on a 2-core Zen 3 (bench/results/torch-dtype-zen3.md),
the default target's 300-token prefill ran at 6.3 rows/s in bf16 against
24.6-28.5 in float32, while a one-token decode step (memory-bound: it reads
every weight once) took 263 ms in bf16 against 518-691 in float32.

So the weights stay bf16 (half the bytes a decode step reads, half the memory)
and a pass of WIDE_ROWS rows or more (a prompt's prefill, training's batched
answers, a long verification) copies each weight into a reused float32 scratch
buffer and multiplies in float32; its output is rounded to bf16 like the bf16
product's. bf16 -> float32 is exact, so the product is the float32 product of
the same values: it differs from oneDNN's bf16 kernel only in summation order
(the same kind of rounding difference as between batch shapes, which the
README's bf16 exactness rates already cover). Float32 models never take this
path, so the float32 identity tests are untouched.

The scratch buffer is reused because a fresh float32 copy of a weight costs
more than the product it saves: 8 weights of 8960x1536 took 311 ms through
`.float()` (new pages faulted in) and 35 ms through `copy_` into kept memory.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

WIDE_ROWS = 24  # measured crossover on Zen 3: 17 rows level, 33 rows 1.6x faster in float32
SCRATCH_ELEMENTS = 16 * 1024 * 1024  # 64 MB of float32; larger weights go in row chunks
_local = threading.local()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX).
    SPECDECODE_WIDE_F32=1 / 0 forces the float32 path on / off (for measurements)."""
    forced = os.environ.get("SPECDECODE_WIDE_F32")
    if forced in ("0", "1"):
        return forced == "0"
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: True)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def wanted(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of this device and dtype should get WideF32Linear layers."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and not native_bf16()


class WideF32Linear(nn.Linear):
    """An nn.Linear (same parameters, same state_dict) whose bf16 passes of WIDE_ROWS
    rows or more multiply in float32 through the thread's scratch buffer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows < WIDE_ROWS or x.dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        out = product(x.reshape(rows, self.in_features), self.weight, self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def product(x: torch.Tensor,  # [rows, in] any float dtype
            weight: torch.Tensor,  # [out, in] any dtype (bf16, int8...)
            bias: torch.Tensor | None = None,  # [out]
            ) -> torch.Tensor:  # [rows, out] float32
    """x @ weight.T + bias in float32, the weight copied into the thread's scratch buffer
    a block of output rows at a time (no fresh float32 copy of it)."""
    flat = x.float()
    step = max(1, SCRATCH_ELEMENTS // weight.shape[1])
    if step >= weight.shape[0]:  # one block: no output copy
        block = _scratch(*weight.shape)
        return F.linear(flat, block.copy_(weight), None if bias is None else bias.float())
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for first in range(0, weight.shape[0], step):
        last = min(first + step, weight.shape[0])
        block = _scratch(last - first, weight.shape[1])  # [last - first, in]
        block.copy_(weight[first:last])
        out[:, first:last] = F.linear(flat, block,
                                      None if bias is None else bias[first:last].float())
    return out


def _scratch(rows: int, cols: int) -> torch.Tensor:  # -> [rows, cols] float32
    """A [rows, cols] float32 view of this thread's scratch buffer (grown on demand)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = _local.buffer = torch.empty(max(rows * cols, 1 << 20), dtype=torch.float32)
    return buffer[:rows * cols].view(rows, cols)


def install(model: nn.Module) -> int:
    """Turn every nn.Linear in `model` into a WideF32Linear, in place (the same
    parameter tensors, so tied weights and arenas are kept); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = WideF32Linear
            count += 1
    return count
