"""The torch backend's default target in each dtype: prefill rows/s, one decode step,
and a 9-token verification pass in plain steps (c(9)).

    python bench/torch_dtype_rate.py float32 bfloat16 bfloat16-native

Per dtype: a 300-token prefill (the second of two), 8 one-token steps (median),
3 nine-token and 3 33-token passes rolled back (median), and one batched pass
of 64 sequences' next tokens (train/data.collect_batched's shape; the second of
two). "bfloat16" is what the loader gives (on a CPU without bf16 matrix hardware:
wide passes in float32, models/wide_f32.py); "bfloat16-native" forces PyTorch's
own bf16 products everywhere (SPECDECODE_WIDE_F32=0). What it shows: on a CPU without bf16
instructions (AVX2 only) bf16 halves the decode step (half the bytes) but makes
compute-bound passes (prefill, training's teacher-forced states) several times
slower than float32; on AMX/AVX512-BF16 machines both favour bf16.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from specdecode.costs import cpu_name
from specdecode.llm import LLM
from specdecode.options import LoadSpec


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(label: str) -> str:
    dtype = label.removesuffix("-native")
    os.environ["SPECDECODE_WIDE_F32"] = "0" if label.endswith("-native") else ""
    llm = LLM.from_spec(LoadSpec(target="default", backend="torch", drafter="none",
                                 max_seq_len=2048, dtype=dtype))
    target = llm.decoder.target
    ids = torch.tensor([(i * 7919) % 1000 + 100 for i in range(300)])  # in-vocabulary ids
    with torch.inference_mode():
        for _ in range(2):
            target.rollback(0)
            prefill = timed(lambda: target.prefill(ids))
        step = statistics.median(timed(lambda i=i: target.forward(ids[i:i + 1])) for i in range(8))
        c9, c33 = (statistics.median(rolled_back(target, ids[:n]) for _ in range(3)) / step
                   for n in (9, 33))
        batch = batched_pass(target, ids, 64)
    return (f"{label}: prefill {len(ids)} tokens {prefill:.2f} s = {len(ids) / prefill:.1f} "
            f"rows/s; step {step * 1000:.0f} ms; c(9) {c9:.2f}; c(33) {c33:.2f}; "
            f"64 sequences' pass {batch:.2f} s = {64 / batch:.1f} rows/s")


def rolled_back(target, ids: torch.Tensor) -> float:  # ids: [n] int64
    """Seconds of one pass over ids after the cached prefix, then rolled back."""
    base = target.cached_len
    seconds = timed(lambda: target.forward(ids))
    target.rollback(base)
    return seconds


def batched_pass(target, ids: torch.Tensor, n: int) -> float:  # ids: [T] int64
    """Seconds of one pass stepping n sequences (each holding an 8-token prompt) by one
    token: the second of two."""
    seqs = [target.sequence(i) for i in range(1, n + 1)]
    for seq in seqs:
        seq.prefill(ids[:8])
    times = [timed(lambda: target.forward_many([(s, ids[8:9]) for s in seqs], last_n=1))
             for _ in range(2)]
    return times[-1]


def main() -> None:
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads", flush=True)
    for label in sys.argv[1:] or ["float32", "bfloat16", "bfloat16-native"]:
        print(measure(label), flush=True)


if __name__ == "__main__":
    main()
