"""Time to first token on the torch backend with and without models/wide_f32.py: the
default target's and the int8 0.5B draft model's prefill of real prompts, bf16.

    python bench/wide_f32_prefill.py [--rounds 2]

Each round runs every mode in its own process (the switch, SPECDECODE_WIDE_F32, is
read when a model loads), alternating wide / native; per prompt it prints the
target's prefill, the draft model's prefill and their sum (what a request waits for
before its first token, plus one step), in seconds. Prompts: the code-edit workload's
first prompt and the first two HumanEval prompts, in the target's chat template.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {"wide": "1", "native": "0"}


def measure() -> dict:
    """In this process: load the default pair on torch, prefill each prompt in each model."""
    import torch

    from specdecode.bench import workloads
    from specdecode.llm import LLM

    llm = LLM.load("default", backend="torch", drafter="draft-model", max_seq_len=2048,
                   adaptive=False)  # fixed k: no cost curve measured at load
    target = llm.decoder.target
    draft = llm.decoder.drafter.draft_model  # int8 (drafters/draft_model.py)
    prompts = workloads.load("code-edit:1") + workloads.load("humaneval:2")
    out = {"wide_layers": type(target.layers[0].mlp.up_proj).__name__, "prompts": []}
    for prompt in prompts:
        ids = torch.tensor(prompt.ids(llm.tokenizer))  # [T] int64
        row = {"name": prompt.name, "tokens": len(ids)}
        for label, model in (("target", target), ("draft", draft)):
            model.rollback(0)
            start = time.perf_counter()
            model.prefill(ids)
            row[label] = time.perf_counter() - start
        out["prompts"].append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    from specdecode.costs import cpu_name
    print(f"machine: {cpu_name()}", flush=True)
    for round_ in range(args.rounds):
        for mode, flag in MODES.items():
            env = {**os.environ, "SPECDECODE_WIDE_F32": flag}
            done = subprocess.run([sys.executable, __file__, "--child"], env=env,
                                  capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for row in result["prompts"]:
                print(f"round {round_ + 1} {mode:6s} ({result['wide_layers']}) {row['name']:28s} "
                      f"{row['tokens']:5d} tokens: target {row['target']:6.2f} s, draft "
                      f"{row['draft']:6.2f} s, both {row['target'] + row['draft']:6.2f} s",
                      flush=True)


if __name__ == "__main__":
    main()
