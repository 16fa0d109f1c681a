"""Fallback: with every draft token forced wrong (bench/load.py WrongDrafts), the
user's configuration (Pair.speculating) still completes every request with plain
decoding's output, at plain speed within MARGIN (median over prompts of tokens/s
against plain decoding of the same prompt, the two interleaved)."""

from __future__ import annotations

import statistics

from specdecode.bench.load import force_wrong_drafts
from specdecode.check import Row
from specdecode.check.pair import Pair, cold_generate
from specdecode.sampling import SamplingParams

MARGIN = 0.2  # this machine kind's run-to-run spread is about +-10 % (README)


def check_fallback(pair: Pair, prompts: list[tuple[str, list[int]]], max_tokens: int,
                   margin: float = MARGIN) -> list[Row]:
    """One row: outputs as plain (or parted at a near-tie), and the speed ratio."""
    llm = pair.speculating()
    force_wrong_drafts(llm.decoder)
    params = SamplingParams(max_tokens=max_tokens)
    cold_generate(llm, prompts[0][1], SamplingParams(max_tokens=4))  # warm-up
    ratios, verdicts, drafted = [], [], 0
    for _, ids in prompts:
        plain = cold_generate(pair.plain, ids, params, speculative=False)
        wrong = cold_generate(llm, ids, params)
        drafted += wrong.stats.drafted
        ratios.append((len(wrong.token_ids) / wrong.seconds)
                      / (len(plain.token_ids) / plain.seconds))
        verdicts.append(pair.compare(ids, plain.token_ids, wrong.token_ids)[0])
    ratio = statistics.median(ratios)
    same = verdicts.count("identical")
    bugs = verdicts.count("not a tie: BUG")
    ok = not bugs and ratio >= 1 - margin
    detail = (f"{len(prompts)}/{len(prompts)} completed, {same} identical to plain, "
              f"{bugs} not-a-tie divergences; {ratio:.2f}x plain speed (median; pass at "
              f">= {1 - margin:.2f}x); {drafted} wrong draft tokens verified")
    return [Row("fallback", f"{llm.info.drafter} drafts forced wrong", ok, detail, {
        "ratios": ratios, "median_ratio": ratio, "margin": margin, "verdicts": verdicts,
        "drafted": drafted})]
