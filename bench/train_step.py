"""What an EAGLE-3 training step costs, and what leaving out unscored anchors and a
fused optimiser save (train/eagle_fit.py, train/fit.py), on the default target's
head shape (hidden 1536, 12/2 heads, MLP 3072, 8,192 draft ids, 3 aux layers,
4 unrolled steps, bf16 autocast as `specdecode train --precision bf16`).

    python bench/train_step.py [--rounds 5]

Windows shaped like a run's: a prompt tail of 128 (or a shorter prompt's 101)
rows before answers of 256 and 150 tokens, random weights and states (the cost
does not depend on them). Four arms, interleaved round by round, one step each
after two untimed: every anchor (first = 0; the earlier unroll also ran the rows
p < d that have no anchor, slightly more work) or from
first_anchor on, with torch's per-tensor AdamW or its fused one. Prints the median
seconds per step of each arm and the loss of one batch both ways (equal: only
unscored rows are left out).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.costs import cpu_name
from specdecode.drafters.eagle import Eagle3Config, Eagle3Head
from specdecode.train import eagle_fit
from specdecode.train.fit import target_to_draft

V, H = 151936, 1536


def head_and_windows() -> tuple[Eagle3Head, list[eagle_fit.Shard]]:
    torch.manual_seed(0)
    cfg = Eagle3Config(H, 3072, 12, 2, 128, 8192, V, (1, 13, 24), 1e-6, 1e6)
    head = Eagle3Head(cfg, torch.randn(V, H) * 0.02)
    draft_ids = torch.randperm(V)[:8192].sort().values
    head.init_from_target(torch.randn(V, H) * 0.02, draft_ids)
    windows = []
    for prompt, answer in ((128, 256), (101, 150)):
        ids = draft_ids[torch.randint(8192, (prompt + answer + 1,))]
        windows.append(eagle_fit.Shard(torch.randn(prompt + answer, 3 * H).half(), ids,
                                       prompt, 0))
    return head, windows


def all_anchors(shard: eagle_fit.Shard, head: Eagle3Head, t2d: torch.Tensor,
                depths: int) -> tuple[torch.Tensor, int]:
    """The loss's terms over every anchor (what the unroll ran before first_anchor)."""
    total, count = torch.zeros(()), 0
    for d, rows in enumerate(eagle_fit.unrolled_logits(head, shard.features(), shard.ids,
                                                       shard.start, depths)):
        labels = shard.labels(t2d, d)[d:]
        total = total + 0.8 ** d * torch.nn.functional.cross_entropy(
            rows.float(), labels, ignore_index=-100, reduction="sum")
        count += int((labels >= 0).sum()) if d == 0 else 0
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    head, windows = head_and_windows()
    seqs = eagle_fit.Sequences(windows, 4)
    t2d = target_to_draft(head.draft_ids, V)

    def loss(skip: bool) -> torch.Tensor:
        if skip:
            return seqs.loss(head, t2d)
        parts = [all_anchors(w, head, t2d, 4) for w in windows]
        return sum(p[0] for p in parts) / sum(p[1] for p in parts)

    arms = {(skip, fused): torch.optim.AdamW(head.parameters(), lr=1e-6, fused=fused)
            for skip in (False, True) for fused in (False, True)}
    times = {arm: [] for arm in arms}
    for r in range(args.rounds + 2):
        for (skip, fused), opt in arms.items():
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                value = loss(skip)
            opt.zero_grad()
            value.backward()
            opt.step()
            if r >= 2:
                times[(skip, fused)].append(time.perf_counter() - start)
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads; "
          f"{sum(w.aux.shape[0] for w in windows)} rows a step, median of {args.rounds}")
    for (skip, fused), ts in times.items():
        print(f"{'from first_anchor' if skip else 'every anchor':>17}, "
              f"{'fused' if fused else 'per-tensor'} AdamW: {statistics.median(ts):.2f} s")
    with torch.no_grad():
        print(f"loss of one batch: every anchor {float(loss(False)):.6f}, "
              f"from first_anchor {float(loss(True)):.6f} (float32)")


if __name__ == "__main__":
    main()
