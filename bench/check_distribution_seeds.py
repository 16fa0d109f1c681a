"""Is a failing `specdecode check` distribution case chance or a biased verifier?

Captures the case's tensors once (check/distribution.py `capture`, default pair unless
--target), then: the verifier's law computed in float64 against p (a correct rule
gives p exactly), the case's chi-square p-values at --seeds seeds of --draws runs, and
one run of 10x the draws. Chance: the law equals p and other seeds pass.

    python bench/check_distribution_seeds.py > bench/results/check-distribution-seeds.txt
"""

from __future__ import annotations

import argparse

import torch

from specdecode.check import distribution as D
from specdecode.check.chisquare import chi_square_pvalue as chi
from specdecode.check.pair import Pair
from specdecode.costs import cpu_name
from specdecode.options import LoadSpec


def law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # p, q: [V] float64
    """The first emitted token's law under rejection sampling of one draft from q:
    sum_d q(d) [a(d) delta_d + (1 - a(d)) residual], a = min(1, p / q)."""
    a = torch.where(q > 0, (p / q.clamp_min(1e-300)).clamp(max=1.0), torch.zeros_like(q))
    residual = (p - q).clamp_min(0)
    return q * a + (q * (1 - a)).sum() * residual / residual.sum()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--setting", default="T=1.0 top-k 40 top-p 0.9", choices=list(D.SETTINGS))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--draws", type=int, default=4000)
    args = ap.parse_args()
    pair = Pair.load(LoadSpec(target=args.target))
    name, ids = pair.prompts(["humaneval"], 1)[0]
    answer = pair.plain_answer(ids, 32)
    params = D.SETTINGS[args.setting]
    at = D.spread_position(pair, ids, answer, params)
    c = D.capture(pair, ids + answer[:at], params, pair.llm("draft-model", 1).drafter,
                  f"{name} +{at}")
    p, q = c.p0.double(), c.q.double()
    print(f"# {cpu_name()}; {pair.backend}; {args.setting}, draft model q, at {c.where}")
    print(f"support: p {int((p > 0).sum())} tokens, q {int((q > 0).sum())}; TV(p, q) "
          f"{float((p - q).abs().sum() / 2):.4f}")
    print(f"max |law - p| (float64): {float((law(p, q) - p).abs().max()):.3g}")
    for seed in range(args.seeds):
        first, bonus = D.draw(c, params, args.draws, seed)
        bonus_p = chi(bonus, c.p1) if bonus.sum() >= 20 else None
        print(f"seed {seed}: first token p={chi(first, c.p0):.4g} ({args.draws} draws), "
              f"bonus p={bonus_p if bonus_p is None else f'{bonus_p:.4g}'}", flush=True)
    first, _ = D.draw(c, params, 10 * args.draws, 100)
    print(f"seed 100: first token p={chi(first, c.p0):.4g} ({10 * args.draws} draws)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
