"""The "never slower than plain" check: adverse drafts and a load that starts mid-request.

    python bench/never_slower.py --out bench/results/never-slower

One process, one engine (the shipped default on the llama.cpp backend: drafter
auto, adaptive), so plain and speculative decoding run on the same pages and
threads. For each prompt three runs are interleaved: plain decoding, the
shipped default, and the shipped default with every draft token forced wrong
(bench/load.py's WrongDrafts: the worst case for speculation). With
`--load-after S` a busy process starts S seconds into each run and stops at
its end, so every run meets the same load at the same point of the request.
Reported: decoding tokens/s (prefill excluded) per run, and per configuration
the median over prompts of its ratio to plain decoding of the same prompt.
Greedy (T=0), 128 new tokens. One heavy process: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
from pathlib import Path

from specdecode.bench import workloads
from specdecode.bench.load import WrongDrafts, busy_load
from specdecode.costs import cpu_name
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams


@contextlib.contextmanager
def load_after(seconds: float | None, n: int):
    """n busy processes from `seconds` after entering until the block ends (None: none)."""
    stack, started = contextlib.ExitStack(), threading.Event()
    timer = None
    if seconds is not None and n > 0:
        def start() -> None:
            stack.enter_context(busy_load(n))
            started.set()
        timer = threading.Timer(seconds, start)
        timer.start()
    try:
        yield started
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
        stack.close()


def run_one(llm: LLM, ids: list[int], mode: str, n: int, load: tuple) -> dict:
    """One greedy generation: plain, auto, or auto with wrong drafts."""
    slots = llm.decoder.controller.slots if llm.decoder.controller else []
    inner = [slot.drafter for slot in slots]
    # The wrong runs' pauses must not carry into the honest runs (and back).
    saved = [(s.failures, s.paused, s.probing, list(s.recent), dict(s.carried))
             for s in slots]
    if mode == "wrong":
        for slot in slots:
            slot.drafter = WrongDrafts(slot.drafter, llm.target.vocab_size)
    try:
        with load_after(*load) as started:
            r = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n),
                             speculative=mode != "plain")
            loaded = started.is_set()
    finally:
        for slot, drafter, state in zip(slots, inner, saved):
            slot.drafter = drafter
            if mode == "wrong":
                slot.failures, slot.paused, slot.probing, recent, slot.carried = state
                slot.recent.clear()
                slot.recent.extend(recent)
    s = r.stats
    return {"tokens": r.token_ids, "tps": s.tokens_per_second, "drafted": s.drafted,
            "accepted": s.accepted, "steps": s.steps, "load_started": loaded,
            "drafter_steps": s.drafter_steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/never-slower")
    ap.add_argument("-w", "--workload", action="append", dest="workloads", default=None,
                    help="workloads (default humaneval:3, code-edit:2, chat:3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--load-after", type=float, default=None, metavar="S",
                    help="start the busy load S seconds into each run (default: no load)")
    ap.add_argument("--background-load", type=int, default=1, metavar="N")
    ap.add_argument("--target", default="default",
                    help="registry name or GGUF path (default: the default pair)")
    ap.add_argument("--drafter", default=None, help="as LLM.load's (default: its default)")
    args = ap.parse_args()
    llm = LLM.load(args.target, backend="llama.cpp", max_seq_len=4096, drafter=args.drafter)
    prompts = [p for w in args.workloads or ["humaneval:3", "code-edit:2", "chat:3"]
               for p in workloads.load(w)]
    modes = ("plain", "auto", "wrong")
    warm = prompts[0].ids(llm.tokenizer)[:64]
    for mode in modes:
        run_one(llm, warm, mode, 8, (None, 0))
    rows = []
    for p in prompts:
        ids = p.ids(llm.tokenizer)
        for mode in modes:
            row = {"prompt": p.name, "workload": p.workload, "mode": mode,
                   **run_one(llm, ids, mode, args.max_tokens,
                             (args.load_after, args.background_load))}
            rows.append(row)
            print(f"{p.name:20} {mode:6} {row['tps']:6.2f} tok/s drafted {row['drafted']:4} "
                  f"accepted {row['accepted']:4} load {row['load_started']}", file=sys.stderr,
                  flush=True)
    summary = summarise(rows, modes)
    meta = {"command": " ".join(sys.argv), "cpu": cpu_name(), "choice": llm.info.choice,
            "costs": llm.info.costs, "load_after": args.load_after,
            "background_load": args.background_load}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                    "runs": rows}, indent=1))
    print(json.dumps({"meta": meta, "summary": summary}, indent=1))
    return 0


def summarise(rows: list[dict], modes: tuple[str, ...]) -> list[dict]:
    """Per workload and mode: median tok/s, median and min ratio to plain (per prompt),
    and whether greedy output equals plain decoding's."""
    by = {(r["prompt"], r["mode"]): r for r in rows}
    out = []
    for wl in [*dict.fromkeys(r["workload"] for r in rows), "all"]:
        names = list(dict.fromkeys(r["prompt"] for r in rows if wl in ("all", r["workload"])))
        for mode in modes:
            ratios = [by[(n, mode)]["tps"] / by[(n, "plain")]["tps"] for n in names]
            out.append({"workload": wl, "mode": mode,
                        "tps": statistics.median(by[(n, mode)]["tps"] for n in names),
                        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                        "identical": sum(by[(n, mode)]["tokens"] == by[(n, "plain")]["tokens"]
                                         for n in names), "prompts": len(names)})
    return out


if __name__ == "__main__":
    sys.exit(main())
