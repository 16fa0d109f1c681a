"""Distil a final-hidden-state head from the default target and measure it.

    python bench/hidden_head.py --prompts 80 --steps 400 --out bench/results/hidden-head

On the llama.cpp backend (it exposes the final hidden state): the target
answers training prompts greedily (train/data.py: the training sets only,
then prompts made from standard-library docstrings), the head is trained on
its answers and states (train/fit.py), and its greedy acceptance per depth and
tau at k = depths are measured on the target's answers to held-out HumanEval
prompts (collected the same way, never trained on). Then, interleaved per
prompt: plain decoding and the head drafting a fixed k (tokens/s, decoding
only) — what the head's acceptance buys on this backend's cost curve.
Shards are cached (a rerun resumes); the summary and the learning curve
(PNG) are written to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdecode.bench import workloads
from specdecode.costs import cpu_name
from specdecode.drafters.hidden_head import HiddenHeadDrafter
from specdecode.engine import SpeculativeDecoder
from specdecode.llm import LLM
from specdecode.models import registry
from specdecode.sampling import SamplingParams
from specdecode.train import data, fit
from specdecode.train.run import plot_curve, prompt_set, target_tables


def speed(llm: LLM, drafter, prompts: list[list[int]], ks: list[int], n: int) -> list[dict]:
    """Per prompt, interleaved: plain and the head at each k (decode tok/s)."""
    rows = []
    for ids in prompts:
        for k in [0, *ks]:
            dec = SpeculativeDecoder(llm.decoder.target, drafter if k else None, k or 1,
                                     eos_token_ids=llm.decoder.eos_token_ids)
            out = dec.generate(ids, SamplingParams(max_tokens=n))
            s = out.stats
            rows.append({"k": k, "tps": len(out.token_ids) / max(s.decode_time, 1e-9),
                         "tokens": out.token_ids, "drafted": s.drafted, "accepted": s.accepted})
            print(f"k={k} {rows[-1]['tps']:.2f} tok/s accepted {s.accepted}/{s.drafted}",
                  file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--out", default="bench/results/hidden-head")
    args = ap.parse_args()
    llm = LLM.load("default", backend="llama.cpp", drafter="none", max_seq_len=2048)
    target, tok = llm.decoder.target, llm.tokenizer
    path = registry.resolve("default")
    encode = lambda p: tok.chat([{"role": "user", "content": p}])  # noqa: E731
    cache = Path.home() / ".cache" / "specdecode" / "train" / path.stem
    stops = llm.decoder.eos_token_ids
    started = time.perf_counter()
    train_paths = data.collect(target, encode, prompt_set(args.prompts),
                               cache / "greedy", max_new_tokens=args.max_new_tokens,
                               stop_ids=stops)
    collect_s = time.perf_counter() - started
    held = workloads.load(f"humaneval:{args.eval_prompts}")
    eval_paths = _collect_ids(target, [p.ids(tok) for p in held], cache / "humaneval-eval",
                              args.max_new_tokens, stops)
    train, val = data.load_shards(train_paths), data.load_shards(eval_paths)
    embed, lm_head = target_tables(target, path)
    d2t = fit.draft_vocabulary(train, args.draft_vocab, embed.shape[0], always=stops)
    head = fit.new_head(embed, lm_head.float(), d2t)
    wt, wv = fit.Windows.of(train, args.depths), fit.Windows.of(val, args.depths)
    untrained = fit.acceptance(head, wv)
    result = fit.fit(head, wt, wv, steps=args.steps, batch=args.batch, evals=8,
                     report=lambda p: print(json.dumps(p), file=sys.stderr, flush=True))
    head.save(cache / "head")  # ~125 MB: the cache, not the repository
    ks = [int(k) for k in args.ks.split(",")]
    rows = speed(llm, HiddenHeadDrafter(head), [p.ids(tok) for p in held[:3]], ks, 128)
    summary = {"cpu": cpu_name(), "command": " ".join(sys.argv), "train_windows": len(wt),
               "train_tokens": sum(len(t) for t, _ in train), "collect_s": collect_s,
               "train_s": result.seconds, "untrained_accept": untrained,
               "curve": result.curve, "tau_eval": result.tau,
               "speed": _speed_summary(rows, ks)}
    Path(args.out + ".json").write_text(json.dumps({**summary, "runs": rows}, indent=1))
    plot_curve(result.curve, Path(args.out + ".png"))
    print(json.dumps(summary, indent=1))
    return 0


def _collect_ids(target, prompts: list[list[int]], folder: Path, n: int, stops) -> list[Path]:
    """data.collect for prompts already tokenised."""
    return data.collect(target, lambda i: prompts[i], list(range(len(prompts))), folder,
                        max_new_tokens=n, stop_ids=stops)


def _speed_summary(rows: list[dict], ks: list[int]) -> dict:
    plain = [r for r in rows if r["k"] == 0]
    out = {}
    for k in ks:
        mine = [r for r in rows if r["k"] == k]
        out[f"k={k}"] = {"ratio_median": statistics.median(
            a["tps"] / b["tps"] for a, b in zip(mine, plain, strict=True)),
            "identical": sum(a["tokens"] == b["tokens"] for a, b in zip(mine, plain,
                                                                          strict=True))}
    return out


if __name__ == "__main__":
    sys.exit(main())
