"""The verifier's law on the pair's real distributions.

Capture: at a few positions of a real request, the target's logits there and after
the drafter's likeliest token, and the draft model's q (its own `propose`, with the
request's params). Draw: run the engine's verifier functions (verify.rejection_sample
for drafts with q, verify.match_sample for point-mass drafts) `draws` times on those
tensors with fresh randomness, no model calls. Test: the first emitted token against
p (chi-square), and the bonus token after the likeliest draft was accepted against
p after it. `rejection=` replaces the rejection sampler (a test passes a broken one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.check import Row
from specdecode.check.chisquare import chi_square_pvalue
from specdecode.check.pair import Pair, cold_generate
from specdecode.drafters.base import DraftContext
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.verify import RejectionSampler, match_sample, rejection_sample

SETTINGS = {"T=0.7": SamplingParams(temperature=0.7), "T=1.0": SamplingParams(temperature=1.0),
            "T=1.0 top-k 40 top-p 0.9": SamplingParams(temperature=1.0, top_k=40, top_p=0.9)}
ALPHA = 1e-3  # a case fails when its p-value is below this (fixed seeds: no flakes)


@dataclass
class Capture:
    """One position: p0 [V] target probs there, q [V] draft probs or None (a point
    mass on d), d the draft token whose next row p1 [V] is kept."""

    where: str
    p0: torch.Tensor
    q: torch.Tensor | None
    d: int
    p1: torch.Tensor


def capture(pair: Pair, context: list[int], params: SamplingParams, drafter, where: str
            ) -> Capture:
    """The tensors of one position; drafter None: a point mass on p0's second token."""
    target = pair.plain.target
    p0 = logits_to_probs(target.prefill(torch.tensor(context)).logits[-1], params)  # [V]
    q = None
    if drafter is not None:
        g = torch.Generator().manual_seed(0)
        drafter.begin(context, params, g)
        q = drafter.propose(DraftContext(list(context), 1, params, g, len(context))).q[0]
        d = int(q.argmax())
    else:
        d = int(p0.topk(2).indices[1])
    p1 = logits_to_probs(target.prefill(torch.tensor(context + [d])).logits[-1], params)
    target.rollback(0)
    return Capture(where, p0, None if q is None else q.to(p0.device), d, p1)


def draw(c: Capture, draws: int, seed: int, rejection: RejectionSampler
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-token counts [V], bonus counts [V] after d was accepted)."""
    g = torch.Generator(device=c.p0.device).manual_seed(seed)
    first, bonus = torch.zeros_like(c.p0, dtype=torch.float64), torch.zeros_like(
        c.p0, dtype=torch.float64)
    other = torch.stack((c.p0, c.p0))  # rows when the draft is not d: row 1 is not read
    for _ in range(draws):
        d = c.d if c.q is None else sample(c.q, g)
        p = torch.stack((c.p0, c.p1)) if d == c.d else other  # [2, V]
        tokens = torch.tensor([d])
        if c.q is None:
            u = torch.rand(2, generator=g, dtype=torch.float64, device=c.p0.device).tolist()
            result = match_sample(tokens, p, lambda i, u=u: u[i])
        else:
            result = rejection(tokens, p, c.q[None], g)
        first[result.tokens[0]] += 1
        if result.num_accepted == 1 and d == c.d:
            bonus[result.tokens[1]] += 1
    return first, bonus


def check_distribution(pair: Pair, prompts: list[tuple[str, list[int]]], draws: int,
                       seed: int = 0, rejection: RejectionSampler = rejection_sample,
                       positions: int = 1) -> list[Row]:
    """One row per (setting, drafter kind): chi-square of the first and bonus tokens."""
    name, ids = prompts[0]
    greedy = cold_generate(pair.plain, ids, SamplingParams(max_tokens=8 * positions),
                           speculative=False).token_ids
    drafters = [("point mass", None)]
    if "draft-model" in pair.drafters:
        drafters.insert(0, ("draft model q", pair.llm("draft-model", 1).drafter))
    rows = []
    for setting, params in SETTINGS.items():
        for kind, drafter in drafters:
            for j in range(positions):
                at = 4 + 8 * j
                c = capture(pair, ids + greedy[:at], params, drafter, f"{name} +{at}")
                rows.append(_row(c, draw(c, draws, seed, rejection), f"{setting}, {kind}"))
    return rows


def _row(c: Capture, counts: tuple[torch.Tensor, torch.Tensor], case: str) -> Row:
    first, bonus = counts
    p_first = chi_square_pvalue(first, c.p0)
    p_bonus = chi_square_pvalue(bonus, c.p1) if bonus.sum() >= 20 else None
    tv = None if c.q is None else float((c.p0 - c.q).abs().sum() / 2)
    ok = p_first >= ALPHA and (p_bonus is None or p_bonus >= ALPHA)
    detail = (f"{c.where}: first token p={p_first:.3g} ({int(first.sum())} draws), bonus "
              + ("not enough accepts" if p_bonus is None
                 else f"p={p_bonus:.3g} ({int(bonus.sum())})")
              + ("" if tv is None else f", TV(p, q)={tv:.3f}"))
    return Row("distribution", case, ok, detail, {
        "where": c.where, "p_first": p_first, "p_bonus": p_bonus, "tv_p_q": tv,
        "draws": int(first.sum()), "bonus_draws": int(bonus.sum()), "alpha": ALPHA})
