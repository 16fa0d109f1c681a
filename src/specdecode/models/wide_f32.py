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

The scratch buffer (SCRATCH_ELEMENTS floats, 64 MB, one per process) is reused
because a fresh float32 copy of a weight costs more than the product it saves:
8 weights of 8960x1536 took 311 ms through `.float()` (new pages faulted in)
and 35 ms through `copy_` into kept memory. The input is taken ROW_BLOCK rows
at a time and each block's product written straight into the bf16 output, so
a long prefill holds no float32 copy of a whole layer's activations.

Only x86-64 CPUs are probed (torch.cpu's AVX512-BF16 / AMX checks); elsewhere
(ARM's bf16 extensions, not measured here) nothing changes. Passes with
autograd on (training) keep the plain product.
"""

from __future__ import annotations

import os
import platform
import threading

import torch
import torch.nn.functional as F
from torch import nn

WIDE_ROWS = 24  # measured on Zen 3: a 17-row pass level, 33 rows 2x faster in float32
SCRATCH_ELEMENTS = 16 * 1024 * 1024  # 64 MB of float32; larger weights go in row blocks
SCRATCH_BYTES = 4 * SCRATCH_ELEMENTS  # for the memory plan (memory.py)
ROW_BLOCK = 512  # input rows per float32 product
_scratch = {"buffer": None}
_lock = threading.Lock()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX; any
    CPU that is not x86-64 counts as yes). SPECDECODE_WIDE_F32=1 / 0 forces the float32
    path on / off for the models loaded after it is set (for measurements)."""
    forced = os.environ.get("SPECDECODE_WIDE_F32")
    if forced in ("0", "1"):
        return forced == "0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: True)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def wanted(device: str | torch.device, dtype: str | torch.dtype) -> bool:
    """Whether a model of this device and dtype ("bfloat16", "bf16" or torch.bfloat16)
    should get WideF32Linear layers."""
    bf16 = str(dtype).removeprefix("torch.") in ("bfloat16", "bf16")
    return str(device).startswith("cpu") and bf16 and not native_bf16()


def applies(x: torch.Tensor, rows: int) -> bool:  # x: [..., in]
    """Whether a pass of `rows` rows of x takes the float32 product: bf16 on the CPU,
    WIDE_ROWS rows or more, autograd off (inference)."""
    return (rows >= WIDE_ROWS and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not torch.is_grad_enabled())


class WideF32Linear(nn.Linear):
    """An nn.Linear (same parameters, same state_dict) whose wide bf16 passes (see
    `applies`) multiply in float32 through the scratch buffer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if not applies(x, rows) or self.weight.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        out = product(x.reshape(rows, self.in_features), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def product(x: torch.Tensor,  # [rows, in] bf16
            weight: torch.Tensor,  # [out, in] any dtype (bf16, int8...)
            bias: torch.Tensor | None = None,  # [out]
            scale: torch.Tensor | None = None,  # [out]: per output channel, after the product
            ) -> torch.Tensor:  # [rows, out] in x's dtype
    """(x @ weight.T) * scale + bias, computed in float32 and rounded once to x's dtype:
    the weight copied into the scratch buffer a block of output rows at a time, the
    input taken ROW_BLOCK rows at a time."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, SCRATCH_ELEMENTS // weight.shape[1])
    with _lock:
        for first in range(0, weight.shape[0], step):
            last = min(first + step, weight.shape[0])
            block = _buffer()[:(last - first) * weight.shape[1]].view(last - first, -1)
            block.copy_(weight[first:last])  # [last - first, in] float32
            b = None if bias is None else bias[first:last].float()
            s = None if scale is None else scale[first:last].float()
            for r in range(0, x.shape[0], ROW_BLOCK):
                y = F.linear(x[r:r + ROW_BLOCK].float(), block)  # [<= ROW_BLOCK, last - first]
                if s is not None:
                    y.mul_(s)
                if b is not None:
                    y.add_(b)
                out[r:r + ROW_BLOCK, first:last] = y
    return out


def _buffer() -> torch.Tensor:  # [SCRATCH_ELEMENTS] float32
    """The process's scratch buffer (made on first use, outside inference mode so that
    later passes may write it whatever mode they run in); callers hold _lock."""
    if _scratch["buffer"] is None:
        with torch.inference_mode(False):
            _scratch["buffer"] = torch.empty(SCRATCH_ELEMENTS, dtype=torch.float32)
    return _scratch["buffer"]


def install(model: nn.Module) -> int:
    """Turn every nn.Linear in `model` into a WideF32Linear, in place (the same
    parameter tensors, so tied weights and arenas are kept); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = WideF32Linear
            count += 1
    return count
