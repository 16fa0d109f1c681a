"""Default pair vs HF transformers, side by side, interleaved in one process.

    python bench/pair_vs_hf.py [--max-tokens 128] [--out bench/results/pair_vs_hf]

HumanEval prompts (5): specdecode plain, draft model (int8 and bf16 draft),
HF plain, HF assisted generation (assistant_model = the 0.5B).
Code-edit prompts (2): specdecode plain, n-gram, HF plain, HF prompt lookup.
Greedy, bf16, 128 new tokens, every configuration run once per prompt in
turn (interleaved) after a warm-up; tokens/s = new tokens / wall seconds
(prefill included) for every configuration alike; medians per workload.
Writes a JSON file and a Markdown table; prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specdecode import NgramDrafter, SamplingParams
from specdecode.bench import hf_peer, workloads
from specdecode.llm import LLM, make_draft_model_drafter
from specdecode.models import loading, registry
from specdecode.models.quant import quantize_int8


def machine() -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--humaneval", type=int, default=5)
    ap.add_argument("--edits", type=int, default=2)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--ngram-k", type=int, default=24)
    ap.add_argument("--out", default="bench/results/pair_vs_hf")
    args = ap.parse_args()

    target_path, draft_path = registry.pull("default")
    t = loading.load(target_path, dtype="bfloat16")
    d16 = loading.load(draft_path, dtype="bfloat16")
    d8 = loading.load(draft_path, dtype="bfloat16")
    quantize_int8(d8.model)
    tok = t.tokenizer
    eos = tok.eos_token_ids[0]
    llm = {
        "specdecode plain": LLM(t.model, tok, None, 0),
        "specdecode draft-model (int8 draft)": LLM(t.model, tok, make_draft_model_drafter(
            d8.model, d8.tokenizer, t.model, tok, confidence_threshold=0.3), args.k),
        "specdecode draft-model (bf16 draft)": LLM(t.model, tok, make_draft_model_drafter(
            d16.model, d16.tokenizer, t.model, tok, confidence_threshold=0.3), args.k),
        "specdecode n-gram": LLM(t.model, tok, NgramDrafter(max_n=3, min_n=1), args.ngram_k),
    }
    hf_ok = hf_peer.available()
    if hf_ok:
        hf_target = hf_peer.load_gguf(target_path)
        hf_draft = hf_peer.load_gguf(draft_path)
    else:
        print("HF transformers peer not installed: skipped", file=sys.stderr)

    def run(config: str, prompt_ids: list[int]) -> dict:
        if config.startswith("specdecode"):
            r = llm[config].generate(prompt_ids, SamplingParams(max_tokens=args.max_tokens))
            s = r.stats
            return {"token_ids": r.token_ids, "seconds": r.seconds, "acceptance_rate":
                    s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                    "draft_time": s.draft_time, "verify_time": s.verify_time}
        kw = {"assistant": hf_draft} if "assisted" in config else {}
        if "prompt lookup" in config:
            kw["prompt_lookup"] = 10
        r = hf_peer.generate(hf_target, prompt_ids, args.max_tokens, eos, **kw)
        return {"token_ids": r.token_ids, "seconds": r.seconds}

    plans = {
        "humaneval": ["specdecode plain", "specdecode draft-model (int8 draft)",
                      "specdecode draft-model (bf16 draft)", "HF plain", "HF assisted"],
        "code-edit": ["specdecode plain", "specdecode n-gram", "HF plain", "HF prompt lookup"],
    }
    prompts = workloads.humaneval(args.humaneval) + workloads.code_edit(args.edits)
    warm = tok.chat([{"role": "user", "content": "Say hi."}])
    for config in {c for cs in plans.values() for c in cs}:
        if config.startswith("HF") and not hf_ok:
            continue
        if config in llm:
            llm[config].generate(warm, SamplingParams(max_tokens=8))
        elif "assisted" in config:
            hf_peer.generate(hf_target, warm, 8, eos, assistant=hf_draft)
        else:
            hf_peer.generate(hf_target, warm, 8, eos)

    rows = []
    for prompt in prompts:
        ids = tok.chat(list(prompt.messages))
        for config in plans[prompt.workload]:
            if config.startswith("HF") and not hf_ok:
                continue
            r = run(config, ids)
            r.update(workload=prompt.workload, prompt=prompt.name, config=config,
                     prompt_tokens=len(ids), new_tokens=len(r["token_ids"]),
                     tokens_per_second=len(r["token_ids"]) / r["seconds"])
            rows.append(r)
            print(f"{prompt.name:22s} {config:38s} {r['tokens_per_second']:6.2f} tok/s "
                  f"({r['new_tokens']} tokens)", file=sys.stderr, flush=True)

    report = summarise(rows, plans)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "date": time.strftime("%Y-%m-%d"),
         "summary": report["summary"], "runs": rows}, indent=1))
    out.with_suffix(".md").write_text(report["markdown"])
    print(report["markdown"])
    return 0


def summarise(rows: list[dict], plans: dict) -> dict:
    summary, lines = [], []
    m = machine()
    lines += [f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; bf16, greedy.",
              "", "| workload | configuration | median tok/s | vs specdecode plain | "
              "vs HF plain | acceptance | tau | identical to its plain |",
              "|---|---|---|---|---|---|---|---|"]
    for workload, configs in plans.items():
        wrows = [r for r in rows if r["workload"] == workload]
        by = {c: [r for r in wrows if r["config"] == c] for c in configs}
        med = {c: statistics.median(r["tokens_per_second"] for r in rs) for c, rs in by.items()
               if rs}
        for c in configs:
            if c not in med:
                continue
            plain_name = "specdecode plain" if c.startswith("specdecode") else "HF plain"
            same = [a["token_ids"] == b["token_ids"] for a, b in zip(by[c], by[plain_name])]
            acc = [r["acceptance_rate"] for r in by[c] if "acceptance_rate" in r]
            tau = [r["mean_accepted_length"] for r in by[c] if "mean_accepted_length" in r]
            entry = {"workload": workload, "config": c, "median_tokens_per_second": med[c],
                     "vs_specdecode_plain": med[c] / med["specdecode plain"],
                     "vs_hf_plain": med[c] / med["HF plain"] if "HF plain" in med else None,
                     "identical_to_plain": f"{sum(same)}/{len(same)}",
                     "acceptance_rate": statistics.median(acc) if acc else None,
                     "mean_accepted_length": statistics.median(tau) if tau else None}
            summary.append(entry)
            lines.append(
                f"| {workload} | {c} | {med[c]:.2f} | {entry['vs_specdecode_plain']:.2f}x | "
                + (f"{entry['vs_hf_plain']:.2f}x" if entry["vs_hf_plain"] else "-") + " | "
                + (f"{entry['acceptance_rate']:.2f}" if acc else "-") + " | "
                + (f"{entry['mean_accepted_length']:.2f}" if tau else "-") + " | "
                + f"{entry['identical_to_plain']} |")
    return {"summary": summary, "markdown": "\n".join(lines) + "\n"}


if __name__ == "__main__":
    sys.exit(main())
