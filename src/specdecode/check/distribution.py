"""The verifier's law on the pair's real distributions.

Capture: at a few positions of a real request, the target's logits there and after
the drafter's likeliest token, and the draft model's q (its own `propose`, with the
request's params). Draw: run the request's verifier (verify.SamplingVerifier: rejection
sampling for drafts with q, draw-and-match for point-mass drafts) `draws` times on
those tensors, a fresh request key each, no model calls. Test: the first emitted
token against p (chi-square), and the bonus token after the likeliest draft was
accepted against p after it. A case below ALPHA is drawn again, CONFIRM times as
many runs from another seed, and fails only if those fall below ALPHA too: a correct
rule fails a try by chance about once in 1/(2 ALPHA) cases (two p-values), and the
captured tensors (so the draws) differ per machine, backend and run, so a fixed seed
alone does not keep a user's run from such a false alarm (the default pair on
llama.cpp, Zen 5: p = 0.00045 at seed 0 in two runs of check; other seeds and more
draws: bench/check_distribution_seeds.py). `verifier=` replaces the rule
(tests/test_check.py passes one that always accepts: it must fail).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.check import Row
from specdecode.check.chisquare import chi_square_pvalue
from specdecode.check.pair import Pair
from specdecode.drafters.base import DraftContext
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.verify import SamplingVerifier

SETTINGS = {"T=0.7": SamplingParams(temperature=0.7), "T=1.0": SamplingParams(temperature=1.0),
            "T=1.0 top-k 40 top-p 0.9": SamplingParams(temperature=1.0, top_k=40, top_p=0.9)}
ALPHA = 1e-3  # a case fails when its p-values are below this twice (see the docstring)
CONFIRM = 4  # the second try draws this many times the runs
CONFIRM_SEED = 1_000_003  # added to the seed for the second try


@dataclass
class Capture:
    """One position: p0 [V] target probs there, q [V] draft probs or None (a point
    mass on d), d the draft token whose next row p1 [V] is kept; position: the
    sequence position p0 is the distribution of."""

    where: str
    position: int
    p0: torch.Tensor
    q: torch.Tensor | None
    d: int
    p1: torch.Tensor


def spread_position(pair: Pair, ids: list[int], answer: list[int], params: SamplingParams
                    ) -> int:
    """The answer position j whose p (under `params`) is most evenly split between its
    likeliest token and the rest (top-1 probability nearest 0.5), so both the accepted
    and the recovered branch of the verifier are drawn often."""
    target = pair.plain.target
    first = target.prefill(torch.tensor(ids)).logits[-1:]  # [1, V]
    rest = target.forward(torch.tensor(answer[:-1]), last_n=len(answer) - 1).logits
    target.rollback(0)
    rows = torch.cat((first, rest[-(len(answer) - 1):]))  # [n, V]: row j predicts answer[j]
    top = torch.stack([logits_to_probs(row, params).max() for row in rows])  # [n]
    return int((top - 0.5).abs().argmin())


def capture(pair: Pair, context: list[int], params: SamplingParams, drafter, where: str
            ) -> Capture:
    """The tensors after `context`; drafter None: a point mass on p0's likeliest token,
    else the drafter's q and its likeliest token."""
    target = pair.plain.target
    p0 = logits_to_probs(target.prefill(torch.tensor(context)).logits[-1], params)  # [V]
    q = None
    if drafter is not None:
        g = torch.Generator().manual_seed(0)
        drafter.begin(context, params, g)
        q = drafter.propose(DraftContext(list(context), 1, params, g, len(context))).q[0]
        d = int(q.argmax())
    else:
        d = int(p0.argmax())
    p1 = logits_to_probs(target.forward(torch.tensor([d])).logits[-1], params)  # [V]
    target.rollback(0)
    return Capture(where, len(context), p0, None if q is None else q.to(p0.device), d, p1)


VerifierFactory = Callable[[SamplingParams, int, torch.Generator], SamplingVerifier]
"""(params, request key, generator) -> an object with SamplingVerifier.verify_probs."""


def draw(c: Capture, params: SamplingParams, draws: int, seed: int,
         verifier: VerifierFactory = SamplingVerifier) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-token counts [V], bonus counts [V] after d was accepted): `draws` runs of
    the request's verifier (a fresh request key each, as separate requests have) on
    the draft d or, with q, on a draft sampled from q."""
    g = torch.Generator(device=c.p0.device).manual_seed(seed)
    keys = random.Random(seed)
    first = torch.zeros_like(c.p0, dtype=torch.float64)  # [V]
    bonus = torch.zeros_like(c.p0, dtype=torch.float64)  # [V]
    for _ in range(draws):
        d = c.d if c.q is None else sample(c.q, g)
        p = torch.stack((c.p0, c.p1 if d == c.d else c.p0))  # [2, V]; row 1 read only for d
        rule = verifier(params, keys.getrandbits(63), g)
        q = None if c.q is None else c.q[None]  # [1, V]
        result = rule.verify_probs(torch.tensor([d]), q, p, c.position)
        first[result.tokens[0]] += 1
        if result.num_accepted == 1 and d == c.d:
            bonus[result.tokens[1]] += 1
    return first, bonus


def check_distribution(pair: Pair, prompts: list[tuple[str, list[int]]], draws: int,
                       seed: int = 0, verifier: VerifierFactory = SamplingVerifier,
                       answer_tokens: int = 32) -> list[Row]:
    """One row per (setting, drafter kind): chi-square of the first and bonus tokens, at
    the most evenly split position of the first prompt's greedy answer (spread_position)."""
    name, ids = prompts[0]
    answer = pair.plain_answer(ids, answer_tokens)
    drafters = [("point mass", None)]
    if "draft-model" in pair.drafters:
        drafters.insert(0, ("draft model q", pair.llm("draft-model", 1).drafter))
    rows = []
    for setting, params in SETTINGS.items():
        at = spread_position(pair, ids, answer, params) if len(answer) > 1 else 0
        for kind, drafter in drafters:
            c = capture(pair, ids + answer[:at], params, drafter, f"{name} +{at}")
            rows.append(judge(c, params, draws, seed, f"{setting}, {kind}", verifier))
    return rows


def judge(c: Capture, params: SamplingParams, draws: int, seed: int, case: str,
          verifier: VerifierFactory = SamplingVerifier) -> Row:
    """The case's row: `draws` runs, and where they fall below ALPHA, CONFIRM times as
    many from seed + CONFIRM_SEED decide (the row keeps the first try's p-values)."""
    row = _row(c, draw(c, params, draws, seed, verifier), case)
    if row.passed:
        return row
    again = draw(c, params, CONFIRM * draws, seed + CONFIRM_SEED, verifier)
    return _row(c, again, case, first_try=row)


def _row(c: Capture, counts: tuple[torch.Tensor, torch.Tensor], case: str,
         first_try: Row | None = None) -> Row:
    first, bonus = counts
    p_first = chi_square_pvalue(first, c.p0)
    p_bonus = chi_square_pvalue(bonus, c.p1) if bonus.sum() >= 20 else None
    tv = None if c.q is None else float((c.p0 - c.q).abs().sum() / 2)
    ok = p_first >= ALPHA and (p_bonus is None or p_bonus >= ALPHA)
    detail = (f"{c.where}: first token p={p_first:.3g} ({int(first.sum())} draws), bonus "
              + ("not enough accepts" if p_bonus is None
                 else f"p={p_bonus:.3g} ({int(bonus.sum())})")
              + ("" if tv is None else f", TV(p, q)={tv:.3f}"))
    data = {"where": c.where, "p_first": p_first, "p_bonus": p_bonus, "tv_p_q": tv,
            "draws": int(first.sum()), "bonus_draws": int(bonus.sum()), "alpha": ALPHA}
    if first_try is not None:
        before = first_try.data
        detail += (f"; drawn again after a first try below {ALPHA:g} (first token "
                   f"p={before['p_first']:.3g}, bonus p="
                   + ("-" if before["p_bonus"] is None else f"{before['p_bonus']:.3g}")
                   + f", {before['draws']} draws)")
        data["first_try"] = {k: before[k] for k in ("p_first", "p_bonus", "draws")}
    return Row("distribution", case, ok, detail, data)
