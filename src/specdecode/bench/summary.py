"""Rows of a bench run -> one summary entry per (workload, temperature, configuration).

Every entry holds (metrics as README.md's Metrics section defines them):
- tokens_per_second: median / min / max over the prompts and repeats
  (new tokens / wall seconds, prefill included, the same for every engine);
- speedup: median over prompts of tokens/s divided by the tokens/s of the same
  engine's plain decoding on the same prompt in the same repeat (paired), and
  the same against the other engine's plain decoding;
- for specdecode drafters: acceptance_rate, mean_accepted_length (tau),
  position_acceptance, mean draft length k_eff, time split, the measured costs
  c_draft (per draft token) and c_verify (per pass) in plain target steps,
  theoretical_speedup = expected tokens per step (i.i.d. alpha, k_eff) / cost
  per step, decode_speedup (prefill excluded) and its ratio to the theory;
- at temperature 0: exact_match (identical outputs / runs) against the same
  engine's plain decoding and, where they differ, the first divergence with
  the target's top-2 logit margin there.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from specdecode.bench import metrics


def margin_at_divergence(target, prompt_ids: list[int], reference: list[int],
                         other: list[int]) -> dict | None:
    """None if `other` equals `reference`; else where it diverges and the target's
    top-2 logit margin there (recomputed by a fresh prefill)."""
    i = metrics.first_divergence(reference, other)
    if i is None:
        return None
    out = {"index": i, "reference_token": reference[i] if i < len(reference) else None,
           "other_token": other[i] if i < len(other) else None}
    logits = target.prefill(torch.tensor(prompt_ids + reference[:i]))
    top = logits.logits[-1].float().topk(2).values
    out["top2_margin"] = float(top[0] - top[1])
    return out


def _paired_speedup(rows: list[dict], base: list[dict]) -> float | None:
    by_key = {(r["prompt"], r["repeat"]): r["tokens_per_second"] for r in base}
    ratios = [r["tokens_per_second"] / by_key[(r["prompt"], r["repeat"])] for r in rows
              if by_key.get((r["prompt"], r["repeat"]))]
    return statistics.median(ratios) if ratios else None


def _merged(rows: list[dict]) -> dict:
    keys = ("steps", "drafted", "accepted", "emitted", "prefill_time", "draft_time",
            "verify_time", "other_time", "wall_time")
    out = {key: sum(r["stats"][key] for r in rows) for key in keys}
    out["guard_plain_steps"] = sum(r["stats"].get("guard_plain_steps", 0) for r in rows)
    n = max(len(r["stats"]["position_tried"]) for r in rows)
    tried, accepted = [0] * n, [0] * n
    for r in rows:
        for i, (t, a) in enumerate(zip(r["stats"]["position_tried"],
                                       r["stats"]["position_accepted"])):
            tried[i] += t
            accepted[i] += a
    out["position_acceptance"] = [a / t if t else 0.0 for a, t in zip(accepted, tried)]
    return out


def summarise(rows: list[dict], configs) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["workload"], r["temperature"], r["config"])].append(r)
    plain_stats = {}
    for (w, t, label), rs in groups.items():
        if label == "specdecode plain":
            plain_stats[(w, t)] = _merged(rs)
    summary = []
    for (workload, temperature, label), rs in groups.items():
        c = next(c for c in configs if c.label == label)
        tps = [r["tokens_per_second"] for r in rs]
        med, lo, hi = metrics.median_spread(tps)
        entry = {"workload": workload, "temperature": temperature, "config": label,
                 "engine": c.engine, "method": c.method, "k": c.k, "runs": len(rs),
                 "tokens_per_second": med, "tokens_per_second_min": lo,
                 "tokens_per_second_max": hi}
        for name, base_label in (("speedup", c.plain_label),
                                 ("vs_specdecode_plain", "specdecode plain"),
                                 ("vs_hf_plain", "HF plain")):
            base = groups.get((workload, temperature, base_label))
            entry[name] = _paired_speedup(rs, base) if base else None
        if c.engine == "specdecode":
            entry.update(_spec_metrics(_merged(rs), plain_stats.get((workload, temperature))))
        if temperature == 0 and c.method != "plain":
            divergences = [dict(r["divergence"], prompt=r["prompt"]) for r in rs
                           if r.get("divergence")]
            checked = [r for r in rs if "divergence" in r]
            entry["exact_match"] = (len(checked) - len(divergences), len(checked))
            entry["divergences"] = divergences
        summary.append(entry)
    order = {c.label: i for i, c in enumerate(configs)}
    summary.sort(key=lambda e: (e["temperature"], e["workload"], order[e["config"]]))
    return summary


def _spec_metrics(m: dict, plain: dict | None) -> dict:
    steps, drafted, accepted, emitted = m["steps"], m["drafted"], m["accepted"], m["emitted"]
    decode = m["draft_time"] + m["verify_time"] + m["other_time"]
    out = {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": emitted / steps if steps else None,
        "position_acceptance": m["position_acceptance"],
        "k_eff": drafted / steps if steps else 0.0,
        "guard_plain_fraction": m["guard_plain_steps"] / steps if steps else 0.0,
        "time_split": {"prefill": m["prefill_time"], "draft": m["draft_time"],
                       "verify": m["verify_time"], "other": m["other_time"]},
        "decode_tokens_per_second": emitted / decode if decode else None,
    }
    if plain is None or not plain["steps"] or not steps:
        return out
    plain_step = plain["verify_time"] / plain["steps"]
    plain_decode = plain["draft_time"] + plain["verify_time"] + plain["other_time"]
    c_draft, c_verify = metrics.step_costs(plain_step, m["draft_time"], m["verify_time"],
                                           drafted, steps)
    out.update(c_draft=c_draft, c_verify=c_verify)
    out["decode_speedup"] = (emitted / decode) / (plain["emitted"] / plain_decode)
    if drafted:
        theory = metrics.theoretical_speedup(out["acceptance_rate"], out["k_eff"], c_draft,
                                             c_verify)
        out["theoretical_speedup"] = theory
        out["measured_over_theoretical"] = out["decode_speedup"] / theory
    return out


def summarise_turns(rows: list[dict]) -> list[dict]:
    """Multi-turn workloads, one entry per (workload, temperature, configuration, turn):
    medians over trajectories of time to first token, prompt tokens, of them reused
    from the prefix cache, and decode tokens/s (prefill excluded; specdecode rows)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if "/turn" in r["prompt"]:
            groups[(r["workload"], r["temperature"], r["config"], r["turn"])].append(r)

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return [{"workload": w, "temperature": t, "config": c, "turn": turn, "runs": len(rs),
             "ttft_seconds": med(r.get("ttft_seconds") for r in rs),
             "prompt_tokens": med(r["prompt_tokens"] for r in rs),
             "cached_tokens": med(r.get("cached_tokens") for r in rs),
             "decode_tokens_per_second": med(
                 r["stats"]["tokens_per_second"] if "stats" in r else None for r in rs),
             "tokens_per_second": med(r["tokens_per_second"] for r in rs)}
            for (w, t, c, turn), rs in sorted(groups.items(), key=lambda kv: (
                kv[0][0], kv[0][1], kv[0][3], kv[0][2]))]
