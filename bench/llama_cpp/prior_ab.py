"""A fresh process's first request, timed: the shipped lookups against one setting undone.

    python bench/llama_cpp/prior_ab.py --workload mt-bench:6 --workload humaneval:4 \
        [--against flat-prior|no-caution]

prior_replay.py predicts from recorded texts; this times the default pair on
this machine (llama.cpp when built), its lookups alone (the draft model, where
the default keeps it, is left out). Each prompt runs three arms in a rotated
order: plain decoding, the shipped lookups (n-gram and suffix; each kind of
match from its prior, drafters/base.py MATCH_PRIORS; free drafts priced with
speclen.LengthPolicy.priced's lower bound) and the same with one of those undone
(`--against`): every kind at 90 % (flat-prior, the default), or point estimates
(no-caution). Every speculative arm gets a fresh controller
(start-up cost prior, nothing learnt: a process's first request, as the
README's demo) and an empty suffix store, so no arm drafts from another's copy
of the same answer. Reported: tokens/s over all of a workload's tokens per
arm, the ratio to plain per prompt (median), and the verified draft tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdecode.bench import workloads
from specdecode.controller import Controller, Slot
from specdecode.costs import cpu_name
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.llm import LLM
from specdecode.sampling import SamplingParams

PLAIN, SHIPPED = "plain", "shipped"
AGAINST = {"flat-prior": "90 % for every kind", "no-caution": "caution 0 (point estimates)"}
UNDO = {AGAINST["flat-prior"]: {"per_kind": False}, AGAINST["no-caution"]: {"caution": 0.0}}
"""fresh_controller's arguments per arm label: what each --against arm undoes."""


def fresh_controller(base: Controller, per_kind: bool = True, caution: float | None = None
                     ) -> Controller:
    """`base`'s lookup slots (the loaded default's controller) anew: start-up prior,
    empty suffix stores; per_kind False: every kind at the policy's prior; caution:
    the policies' (None: the loaded one's)."""
    slots = []
    for slot in base.slots:
        if slot.costly:
            continue
        if isinstance(slot.drafter, SuffixDrafter) and slot.drafter.store is not None:
            slot.drafter.store.clear()
        p = slot.policy
        policy = p.anew() if caution is None else p.anew(caution=caution)
        slots.append(Slot(slot.drafter, policy, False,
                          kind_priors=dict(slot.kind_priors) if per_kind else {}))
    return Controller(slots, base.prior)


def run_arm(llm: LLM, base: Controller, arm: str, ids: list[int], params: SamplingParams
            ) -> dict:
    """One timed greedy request of `arm` (plain, shipped or an AGAINST label) from a
    fresh prefill; tokens/s leave the prefill out. A speculative arm runs on a fresh
    controller built from `base`."""
    if arm != PLAIN:
        llm.decoder._controller = fresh_controller(base, **UNDO.get(arm, {}))
    llm.target.rollback(0)
    start = time.perf_counter()
    result = llm.generate(ids, params, 0, speculative=arm != PLAIN)
    seconds = time.perf_counter() - start - result.stats.prefill_time
    return {"arm": arm, "tokens": len(result.token_ids), "seconds": seconds,
            "drafted": result.stats.drafted, "accepted": result.stats.accepted,
            "token_ids": result.token_ids}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", action="append", required=True, help="e.g. mt-bench:6")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--against", choices=sorted(AGAINST), default="flat-prior",
                    help="the setting the third arm undoes")
    ap.add_argument("--out", default=None, help="write json and markdown here (no suffix)")
    args = ap.parse_args()
    arms = (PLAIN, SHIPPED, AGAINST[args.against])
    llm = LLM.load("default")
    base = llm.decoder.controller
    if base is None or all(s.costly for s in base.slots):
        raise SystemExit("the default has no lookup slots here")
    if any(s.costly for s in base.slots):
        print("note: the default kept its draft model; the arms time the lookups alone",
              file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens)
    first = workloads.load(args.workload[0])[0].ids(llm.tokenizer)
    run_arm(llm, base, PLAIN, first, params)  # warm-up (untimed): page in the weights
    runs = []
    for workload in args.workload:
        for n, prompt in enumerate(workloads.load(workload)):
            ids = prompt.ids(llm.tokenizer)
            for arm in arms[n % 3:] + arms[:n % 3]:  # rotated order
                row = run_arm(llm, base, arm, ids, params)
                runs.append({"workload": workload, "prompt": prompt.name, **row})
                print(f"{workload} {prompt.name} {arm}: {row['tokens'] / row['seconds']:.2f} "
                      f"tok/s, drafted {row['drafted']}, accepted {row['accepted']}",
                      file=sys.stderr, flush=True)
    text = table(runs, llm, arms)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"command": " ".join(sys.argv),
                                                        "runs": runs}, indent=1))
        Path(args.out + ".md").write_text(text)
    return 0


def cpu_family() -> str:
    """/proc/cpuinfo's cpu family (AMD 25: Zen 3/4, 26: Zen 5; '?' elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu family"):
                return line.split(":")[1].strip()
    except OSError:
        pass
    return "?"


def table(runs: list[dict], llm: LLM, arms: tuple[str, ...]) -> str:
    """Markdown: per workload and arm, tokens/s, median per-prompt ratio to plain,
    drafted/accepted; whether every arm's tokens equal plain's."""
    lines = [f"`{' '.join(sys.argv)}`\n",
             f"CPU: {cpu_name()} (family {cpu_family()}), backend "
             f"{llm.info.backend}; start-up c(2) {llm.decoder.controller.prior.c(2):.2f}; "
             "the lookups alone (n-gram and suffix).\n",
             "| workload | arm | tokens/s | median ratio to plain | drafted / accepted | "
             "same tokens as plain |", "|---|---|---|---|---|---|"]
    for workload in dict.fromkeys(r["workload"] for r in runs):
        rows = [r for r in runs if r["workload"] == workload]
        plain = {r["prompt"]: r for r in rows if r["arm"] == PLAIN}
        for arm in arms:
            mine = [r for r in rows if r["arm"] == arm]
            rate = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
            ratio = statistics.median(
                (r["tokens"] / r["seconds"]) / (plain[r["prompt"]]["tokens"]
                                                / plain[r["prompt"]]["seconds"]) for r in mine)
            same = sum(r["token_ids"] == plain[r["prompt"]]["token_ids"] for r in mine)
            lines.append(f"| {workload} | {arm} | {rate:.2f} | {ratio:.3f} | "
                         f"{sum(r['drafted'] for r in mine)} / "
                         f"{sum(r['accepted'] for r in mine)} | {same}/{len(mine)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
