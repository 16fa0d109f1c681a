"""Long verifications on llama.cpp's plain-layout copy or on the repacked weights, A/B.

One process, one target (default, llama.cpp) with its plain-layout copy
(src/specdecode/models/llama_cpp_prefill.py); prompts are prefilled on the copy in
both arms. Arm "copy": passes from the measured length on (or --min-new) go to
the copy, so a draft of 64 n-gram tokens is verified there; arm "repacked": only
passes longer than the longest verification do (min_new = k + 2). Fixed k (no
controller), greedy, each prompt's arms interleaved, --repeats rounds; decoding
tokens/s (prefill excluded), medians. The arms decode the same tokens where the
batches round alike (reported).

    python bench/llama_cpp/plain_copy_ab.py --out bench/results/plain-copy-ab
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("SPECDECODE_FLASH_ATTN", "off")  # as bench/llama_cpp/compare.py

from specdecode import NgramDrafter, SamplingParams, SpeculativeDecoder  # noqa: E402
from specdecode.bench import workloads  # noqa: E402
from specdecode.costs import cpu_name  # noqa: E402
from specdecode.models import llama_cpp_prefill  # noqa: E402
from specdecode.models.llama_cpp import LlamaCppLM  # noqa: E402
from specdecode.models.loading import load_tokenizer  # noqa: E402
from specdecode.models.registry import resolve  # noqa: E402


def run_arm(target: LlamaCppLM, ids: list[int], k: int, min_new: int, n: int) -> dict:
    """One greedy generation with verifications of >= min_new tokens on the copy."""
    target._prefill_copy.min_new = min_new
    result = SpeculativeDecoder(target, NgramDrafter(), k, prefix_cache=False).generate(
        ids, SamplingParams(max_tokens=n))
    s = result.stats
    return {"tps": len(result.token_ids) / (s.wall_time - s.prefill_time),
            "prefill_s": s.prefill_time, "drafted": s.drafted, "accepted": s.accepted,
            "tokens": result.token_ids}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/plain-copy-ab")
    ap.add_argument("-w", "--workload", action="append", dest="workloads",
                    help="NAME:N (default code-edit:2, humaneval:3)")
    ap.add_argument("-k", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-new", type=int, default=None,
                    help="the copy's arm (default: llama_cpp_prefill.decide's measurement)")
    args = ap.parse_args()
    path = resolve("default")
    target = LlamaCppLM(path, max_seq_len=4096, prefill_copy=None)
    if target._prefill_copy is None:
        print("no plain-layout copy on this machine (llama_cpp_prefill.decide)")
        return 1
    arms = {"copy": args.min_new or target._prefill_copy.min_new, "repacked": args.k + 2}
    tok = load_tokenizer(path)
    prompts = [p for w in args.workloads or ["code-edit:2", "humaneval:3"]
               for p in workloads.load(w)]
    runs = []
    for rep in range(args.repeats):
        for p in prompts:
            for arm, min_new in arms.items():
                r = run_arm(target, p.ids(tok), args.k, min_new, args.max_tokens)
                runs.append({"prompt": p.name, "arm": arm, "repeat": rep, **r})
                print(f"{rep} {p.name:20s} {arm:9s} {r['tps']:6.1f} tok/s drafted "
                      f"{r['drafted']} accepted {r['accepted']}", flush=True)
    text = report(runs, prompts, arms, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"command": " ".join(sys.argv),
                                                    "cpu": cpu_name(), "arms": arms,
                                                    "runs": runs}, indent=1))
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


def report(runs: list[dict], prompts, arms: dict, args) -> str:
    """Per prompt: median tok/s of each arm, their ratio, and whether the tokens agree."""
    lines = ["# Long verifications on the plain-layout copy vs the repacked weights\n",
             f"`python {' '.join(sys.argv)}`\n",
             f"CPU: {cpu_name()}, default threads; k = {args.k} n-gram "
             f"drafts, greedy, {args.max_tokens} new tokens, {args.repeats} interleaved "
             f"rounds; arms (min_new): {arms}; probe: "
             f"{llama_cpp_prefill.PROBE_SIZES}\n",
             "| prompt | copy tok/s | repacked tok/s | copy / repacked | same tokens |",
             "|---|---|---|---|---|"]
    ratios = []
    for p in prompts:
        by = {a: [r for r in runs if r["prompt"] == p.name and r["arm"] == a] for a in arms}
        med = {a: statistics.median(r["tps"] for r in rs) for a, rs in by.items()}
        same = by["copy"][0]["tokens"] == by["repacked"][0]["tokens"]
        ratios.append(med["copy"] / med["repacked"])
        lines.append(f"| {p.name} | {med['copy']:.1f} | {med['repacked']:.1f} | "
                     f"{ratios[-1]:.2f}x | {'yes' if same else 'no'} |")
    lines.append(f"\nMedian ratio over prompts: {statistics.median(ratios):.2f}x\n")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
