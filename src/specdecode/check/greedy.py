"""Greedy identity: speculative vs plain greedy output, each drafter in use, each k."""

from __future__ import annotations

from specdecode.check import Row
from specdecode.check.pair import Pair, cold_generate
from specdecode.sampling import SamplingParams


def check_greedy(pair: Pair, prompts: list[tuple[str, list[int]]], ks: list[int],
                 max_tokens: int) -> list[Row]:
    """One row per (drafter, k): passed unless some output parts from plain decoding at
    a position whose top-2 margin is not a near-tie (near_tie.py)."""
    params = SamplingParams(max_tokens=max_tokens)
    plain = {name: pair.plain_answer(ids, max_tokens) for name, ids in prompts}
    rows = []
    for drafter in pair.drafters:
        for k in ks:
            llm = pair.llm(drafter, k)
            rows.append(_row(pair, llm, prompts, plain, params, f"{drafter} k={k}"))
    return rows


def _row(pair: Pair, llm, prompts, plain: dict, params: SamplingParams, case: str) -> Row:
    identical, divergences, accepted, drafted = 0, [], 0, 0
    for name, ids in prompts:
        out = cold_generate(llm, ids, params)
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
        verdict, where = pair.compare(ids, plain[name], out.token_ids)
        if where is None:
            identical += 1
        else:
            divergences.append({**where, "prompt": name, "verdict": verdict})
    bugs = [d for d in divergences if d["verdict"] == "not a tie: BUG"]
    detail = f"{identical}/{len(prompts)} identical, acceptance {accepted}/{drafted}"
    for d in divergences:
        detail += (f"; {d['prompt']} token {d['index']}: margin {d['top2_margin']:.3f} "
                   f"{d['verdict']}")
    return Row("greedy", case, not bugs, detail, {
        "identical": identical, "prompts": len(prompts), "divergences": divergences,
        "accepted": accepted, "drafted": drafted, "near_tie_threshold": pair.limit})
