"""The torch backend's default target in each dtype: prefill rows/s, one decode step,
and a 9-token verification pass in plain steps (c(9)).

    python bench/torch_dtype_rate.py float32 bfloat16

Per dtype: a 300-token prefill (the second of two), 8 one-token steps (median) and
3 nine-token passes rolled back (median). What it shows: on a CPU without bf16
instructions (AVX2 only) bf16 halves the decode step (half the bytes) but makes
compute-bound passes (prefill, training's teacher-forced states) several times
slower than float32; on AMX/AVX512-BF16 machines both favour bf16.
"""

from __future__ import annotations

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


def measure(dtype: str) -> str:
    llm = LLM.from_spec(LoadSpec(target="default", backend="torch", drafter="none",
                                 max_seq_len=2048, dtype=dtype))
    target = llm.decoder.target
    ids = torch.tensor([(i * 7919) % 1000 + 100 for i in range(300)])  # in-vocabulary ids
    with torch.inference_mode():
        for _ in range(2):
            target.rollback(0)
            prefill = timed(lambda: target.prefill(ids))
        step = statistics.median(timed(lambda i=i: target.forward(ids[i:i + 1])) for i in range(8))
        passes = []
        for _ in range(3):
            base = target.cached_len
            passes.append(timed(lambda: target.forward(ids[:9])))
            target.rollback(base)
    return (f"{dtype}: prefill {len(ids)} tokens {prefill:.2f} s = {len(ids) / prefill:.1f} "
            f"rows/s; step {step * 1000:.0f} ms; c(9) {statistics.median(passes) / step:.2f}")


def main() -> None:
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads", flush=True)
    for dtype in sys.argv[1:] or ["float32", "bfloat16"]:
        print(measure(dtype), flush=True)


if __name__ == "__main__":
    main()
