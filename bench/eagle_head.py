"""Measure trained EAGLE-3 heads on the default target: acceptance and tau per workload.

    python bench/eagle_head.py --head ~/heads/qwen-eagle3 --limit 24 \
        --out bench/results/eagle3-default

The target (torch backend) answers the measuring prompts greedily (HumanEval,
MBPP and MT-bench first turns, as `specdecode bench` builds them: never trained
on), batched (train/data.collect_batched), keeping each answer's context shard;
shards are cached (a rerun resumes). Each head's share of answer tokens inside
its draft vocabulary (one outside it is never drafted), its greedy chain
acceptance per depth (eagle_fit.Sequences.acceptance: teacher-forced on the target's own
answer, so what greedy speculation accepts up to the rounding of the target's
batched passes) and tau at each k = 1 + sum(accept[:k]) are written to OUT.json
and OUT.md, with the walked tau (eagle_fit.walked_tau: tokens per step when the
answer is walked as the engine walks it; what `bench` measures, lower because the
engine skips the anchors inside accepted runs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.bench import workloads
from specdecode.costs import cpu_name
from specdecode.drafters.eagle import Eagle3Config
from specdecode.llm import LLM
from specdecode.options import LoadSpec
from specdecode.train import data, eagle_fit
from specdecode.train.speculators import load_any

WORKLOADS = ("humaneval", "mbpp", "mt-bench")


def eval_shards(llm: LLM, workload: str, limit: int, args, cache: Path) -> list[Path]:
    """The target's greedy answers to a measuring workload, as eagle3 context shards."""
    target = llm.decoder.target
    layers = Eagle3Config.default_layers(target.config.num_layers)
    prompts = workloads.load(workload, limit)
    ids = {p.name: p.ids(llm.tokenizer) for p in prompts}
    folder = cache / f"eval-{workload}-{args.max_new_tokens}"
    plan = data.BatchPlan(args.answer_batch, layers, args.context)
    return data.collect_batched(target, lambda name: ids[name], list(ids), folder, plan,
                                max_new_tokens=args.max_new_tokens,
                                stop_ids=llm.decoder.eos_token_ids, progress=True)


def measure(head_dir: Path, embed: torch.Tensor,  # [V, H]
            paths: list[Path], depths: int) -> dict:
    """A head's acceptance per depth and tau per k on the shards of one workload."""
    head = load_any(head_dir, embed, torch.float32)
    windows = eagle_fit.load_windows(paths)
    lengths = eagle_fit.Sequences(windows, depths).chain_lengths(head)
    flat = torch.cat(lengths)
    accept = [float((flat > d).float().mean()) for d in range(depths)]
    answers = torch.cat([w.ids[w.answer_start:] for w in windows])  # [n] int64
    coverage = float(torch.isin(answers, head.draft_ids).float().mean())
    return {"answers": len(windows), "answer_tokens": len(answers), "accept": accept,
            "vocab_coverage": coverage,
            "tau": {k: 1 + sum(accept[:k]) for k in range(1, depths + 1)},
            "walked_tau": {k: eagle_fit.walked_tau(lengths, k) for k in range(1, depths + 1)}}


def table(rows: list[dict], depths: int) -> str:
    head = ("| head | workload | answers | tokens | in draft vocab | "
            + " | ".join(f"accept d{d + 1}" for d in range(depths))
            + " | " + " | ".join(f"tau k={k}" for k in (2, 4, depths) if k <= depths)
            + " | " + " | ".join(f"walked k={k}" for k in (2, 4) if k <= depths) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['head']} | {r['workload']} | {r['answers']} | {r['answer_tokens']} | "
                     f"{r['vocab_coverage']:.1%} | "
                     + " | ".join(f"{a:.2f}" for a in r["accept"]) + " | "
                     + " | ".join(f"{r['tau'][k]:.2f}" for k in (2, 4, depths) if k <= depths)
                     + " | " + " | ".join(f"{r['walked_tau'][k]:.2f}" for k in (2, 4)
                                          if k <= depths) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", type=Path, action="append", required=True)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=24, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--answer-batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("bench/results/eagle3-default"))
    args = ap.parse_args()
    llm = LLM.from_spec(LoadSpec(target="default", backend="torch", drafter="none",
                                 max_seq_len=2048))
    cache = Path.home() / ".cache" / "specdecode" / "train" / "eval"
    embed, rows = llm.decoder.target.embed_tokens.weight, []
    for workload in args.workloads.split(","):
        started = time.perf_counter()
        paths = eval_shards(llm, workload, args.limit, args, cache)
        collect_s = time.perf_counter() - started
        for head_dir in args.head:
            row = {"head": str(head_dir), "workload": workload, "collect_s": collect_s,
                   **measure(head_dir, embed, paths, args.depths)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"machine": cpu_name(), "threads": torch.get_num_threads(), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        if k != "head"}, "heads": [str(h) for h in args.head], "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    md = (f"# EAGLE-3 heads on the default target\n\nMachine: {result['machine']}, "
          f"{result['threads']} threads; `python bench/eagle_head.py` "
          f"{' '.join(f'--head {h}' for h in args.head)} --limit {args.limit} "
          f"--max-new-tokens {args.max_new_tokens}\n\n{table(rows, args.depths)}\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
