"""Two agent conversations taking turns on one engine, with the prefix store and without.

    python bench/prefix_store.py --out bench/results/prefix-store

Users A and B (the agent workload's first two code trajectories:
src/specdecode/bench/agent.py) alternate turns on one LLM, as two clients of one
server do: A1, B1, A2, B2, A3, B3. Each turn's prompt is the conversation so far
plus the next user turn. Both configurations run in this one process, store on
first, then off (each from an empty cache), with the shipped default drafter.
Per turn: prompt tokens, tokens reused (stats.cached_tokens), time to first token
(stats.prefill_time) and decode tok/s; written to OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench import workloads
from specdecode.costs import cpu_name
from specdecode.llm import LLM
from specdecode.options import LoadSpec
from specdecode.prefix_store import PrefixStore
from specdecode.sampling import SamplingParams


def run(llm: LLM, users: list, max_tokens: int) -> list[dict]:
    """Alternate the users' turns; one row per turn."""
    answers: dict[str, list[str]] = {p.name: [] for p in users}
    params, rows = SamplingParams(temperature=0.0, max_tokens=max_tokens), []
    for turn in range(1 + min(len(p.followups) for p in users)):
        for p in users:
            ids = p.turn_ids(llm.tokenizer, answers[p.name])
            r = llm.generate(ids, params)
            answers[p.name].append(r.text)
            decode = r.stats.wall_time - r.stats.prefill_time
            rows.append({"user": p.name, "turn": turn + 1, "prompt_tokens": len(ids),
                         "cached_tokens": r.stats.cached_tokens,
                         "ttft_s": round(r.stats.prefill_time, 3),
                         "decode_tok_s": round((len(r.token_ids) - 1) / decode, 2)
                         if decode > 0 else None, "tokens": len(r.token_ids)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="llama.cpp")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--store-mb", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix-store"))
    args = ap.parse_args()
    llm = LLM.from_spec(LoadSpec(target="default", backend=args.backend, max_seq_len=4096))
    users = [p for p in workloads.load("agent", None) if p.name.startswith("agent-")][:2]
    result = {"machine": cpu_name(), "backend": llm.info.backend, "drafter": llm.info.drafter,
              "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for label, mb in (("store", args.store_mb), ("no store", 0)):
        llm.decoder.prefix_store = PrefixStore(mb << 20) if mb else None
        llm.target.rollback(0)
        result["runs"][label] = run(llm, users, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["| user | turn | prompt tokens | reused, store / none | TTFT s, store / none "
             "| decode tok/s, store / none |", "|---|---|---|---|---|---|"]
    for a, b in zip(result["runs"]["store"], result["runs"]["no store"]):
        lines.append(f"| {a['user']} | {a['turn']} | {a['prompt_tokens']} | "
                     f"{a['cached_tokens']} / {b['cached_tokens']} | {a['ttft_s']} / "
                     f"{b['ttft_s']} | {a['decode_tok_s']} / {b['decode_tok_s']} |")
    md = (f"# Two agent conversations taking turns, prefix store on and off\n\nMachine: "
          f"{result['machine']}; backend {result['backend']}, drafter {result['drafter']}; "
          f"`python bench/prefix_store.py --max-tokens {args.max_tokens}`\n\n"
          + "\n".join(lines) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
