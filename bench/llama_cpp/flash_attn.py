"""llama.cpp's flash attention on or off: the cost of a verification batch, and its rounding.

One process, the default target on the llama.cpp backend, loaded twice (flash attention
on / off; repacked weights, no plain-layout copy). For each context length d (a
standard-library source file's tokens) and batch size b, each arm times a pass of b
new tokens after d cached ones (rolled back after each pass), the arms interleaved,
--repeats rounds, medians. Rounding: each arm's b-token pass against the same tokens
fed one at a time (max |logit difference| over the b rows, and whether the greedy
tokens agree), which is what decides whether speculative output equals plain decoding
on that arm (README "Exactness").

    python bench/llama_cpp/flash_attn.py --out bench/results/flash-attn
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode.argtypes import int_list, positive_int
from specdecode.costs import cpu_name
from specdecode.models.llama_cpp import LlamaCppLM
from specdecode.models.loading import load_tokenizer
from specdecode.models.registry import resolve


def timed_pass(lm: LlamaCppLM, ids: torch.Tensor, d: int, b: int) -> float:  # ids: [>= d+b]
    """Seconds for one pass of ids[d:d+b] after the cached ids[:d]; the cache is left at d."""
    start = time.perf_counter()
    lm.forward(ids[d:d + b], last_n=b)
    seconds = time.perf_counter() - start
    lm.rollback(d)
    return seconds


def rounding(lm: LlamaCppLM, ids: torch.Tensor, d: int, b: int) -> dict:  # ids: [>= d+b]
    """The b-token pass's logits against b one-token steps over the same tokens."""
    batch = lm.forward(ids[d:d + b], last_n=b).logits  # [b, vocab]
    lm.rollback(d)
    steps = torch.cat([lm.forward(ids[d + j:d + j + 1], last_n=1).logits for j in range(b)])
    lm.rollback(d)
    return {"max_abs_diff": float((batch - steps).abs().max()),
            "argmax_equal": bool(torch.equal(batch.argmax(-1), steps.argmax(-1)))}


def measure(arms: dict[str, LlamaCppLM], ids: torch.Tensor, args) -> list[dict]:
    """Every (context, size, arm): median milliseconds over the rounds, and rounding."""
    rows = []
    for d in args.contexts:
        for lm in arms.values():
            lm.prefill(ids[:d])
        times = {(b, arm): [] for b in args.sizes for arm in arms}
        for _ in range(args.repeats):
            for b in args.sizes:
                for arm, lm in arms.items():
                    times[b, arm].append(timed_pass(lm, ids, d, b))
        for b in args.sizes:
            for arm, lm in arms.items():
                exact = rounding(lm, ids, d, b) if b > 1 else {}
                rows.append({"context": d, "size": b, "arm": arm,
                             "ms": 1000 * statistics.median(times[b, arm]),
                             "ms_all": [1000 * t for t in times[b, arm]], **exact})
                print(json.dumps(rows[-1] | {"ms_all": None}), flush=True)
    return rows


def report(rows: list[dict], args) -> str:
    lines = ["# llama.cpp flash attention on / off: verification passes and their rounding\n",
             f"`python {' '.join(sys.argv)}`\n",
             f"CPU: {cpu_name()}, default threads; default target (GGUF, repacked weights); "
             f"{args.repeats} interleaved rounds, median ms per pass of b new tokens after "
             "d cached ones. Rounding: the b-token pass against b one-token steps on the "
             "same arm (max |logit difference|, greedy tokens equal).\n",
             "| context d | b | on: ms | off: ms | on / off | on: max diff (argmax equal) "
             "| off: max diff (argmax equal) |", "|---|---|---|---|---|---|---|"]
    for d in args.contexts:
        for b in args.sizes:
            on, off = (next(r for r in rows if (r["context"], r["size"], r["arm"]) == (d, b, a))
                       for a in ("on", "off"))

            def exact(r: dict) -> str:
                return "-" if "max_abs_diff" not in r else (
                    f"{r['max_abs_diff']:.3g} ({'yes' if r['argmax_equal'] else 'no'})")
            lines.append(f"| {d} | {b} | {on['ms']:.0f} | {off['ms']:.0f} | "
                         f"{on['ms'] / off['ms']:.2f} | {exact(on)} | {exact(off)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/flash-attn")
    ap.add_argument("--contexts", type=int_list, default=[256, 1800])
    ap.add_argument("--sizes", type=int_list, default=[1, 2, 5, 17, 49])
    ap.add_argument("--repeats", type=positive_int, default=5)
    args = ap.parse_args()
    path = resolve("default")
    ids = torch.tensor(load_tokenizer(path).encode(inspect.getsource(argparse)))
    need = max(args.contexts) + max(args.sizes)
    if len(ids) < need:
        raise SystemExit(f"argparse's source has {len(ids)} tokens, fewer than {need}")
    arms = {a: LlamaCppLM(path, max_seq_len=need + 64, flash_attn=a == "on",
                          prefill_copy=False) for a in ("on", "off")}
    rows = measure(arms, ids, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "cpu": cpu_name(), "rows": rows}, indent=1))
    text = report(rows, args)
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
