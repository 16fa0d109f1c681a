"""What an EAGLE-3 training step costs, and what leaving out unscored anchors, a
fused optimiser and unrolling a batch's windows together save (train/eagle_fit.py,
train/fit.py), on the default target's head shape (hidden 1536, 12/2 heads, MLP
3072, 8,192 draft ids, 3 aux layers, 4 unrolled steps, bf16 autocast as
`specdecode train --precision bf16`).

    python bench/train_step.py [--rounds 5] [--windows DIR ...]

Windows: by default two shaped like a run's, a prompt tail of 128 (or a shorter
prompt's 101) rows before answers of 256 and 150 tokens, random states (the cost
does not depend on them); with --windows, a run's own shards (folders of
data.answer_with_context files, e.g. ~/.cache/specdecode/train/<target>/eagle3-*),
a fresh batch of about 512 rows each round as `specdecode train --batch 512`
draws them (greedy labels). Random head weights. Four arms, interleaved round by
round, one step each after two untimed, all on the same batch:
- every anchor, per window: the unroll of each window apart, every anchor
  (first = 0; the earlier unroll also ran the rows p < d that have no anchor,
  slightly more work), fused AdamW;
- from first_anchor, per window: the same from first_anchor on, torch's
  per-tensor AdamW, or
- the fused one;
- packed: the batch's windows unrolled together (eagle_fit.packed_logits, what
  Sequences.loss runs), fused AdamW.
Prints the median seconds per step of each arm and the loss of one batch every
way (float32; equal: only unscored rows are left out, and packing changes only
the order of sums).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdecode.costs import cpu_name
from specdecode.drafters.eagle import Eagle3Config, Eagle3Head
from specdecode.train import eagle_fit
from specdecode.train.fit import DEPTH_DECAY, target_to_draft

V, H, DEPTHS = 151936, 1536, 4


def new_head() -> Eagle3Head:
    torch.manual_seed(0)
    cfg = Eagle3Config(H, 3072, 12, 2, 128, 8192, V, (1, 13, 24), 1e-6, 1e6)
    head = Eagle3Head(cfg, torch.randn(V, H) * 0.02)
    draft_ids = torch.randperm(V)[:8192].sort().values
    head.init_from_target(torch.randn(V, H) * 0.02, draft_ids)
    return head


def synthetic_windows(head: Eagle3Head) -> list[eagle_fit.Shard]:
    windows = []
    for prompt, answer in ((128, 256), (101, 150)):
        ids = head.draft_ids[torch.randint(8192, (prompt + answer + 1,))]
        windows.append(eagle_fit.Shard(torch.randn(prompt + answer, 3 * H).half(), ids,
                                       prompt, 0))
    return windows


def per_window(shards: list[eagle_fit.Shard], head: Eagle3Head, t2d: torch.Tensor,
               every: bool) -> torch.Tensor:
    """The loss with each window unrolled apart, from anchor 0 (every) or first_anchor."""
    total, count = torch.zeros(()), 0
    for s in shards:
        first = 0 if every else eagle_fit.first_anchor(s.answer_start, DEPTHS)
        for d, rows in enumerate(eagle_fit.unrolled_logits(head, s.features(), s.ids,
                                                           s.start, DEPTHS, first)):
            labels = s.labels(t2d, d)[first + d:]
            total = total + DEPTH_DECAY ** d * torch.nn.functional.cross_entropy(
                rows.float(), labels, ignore_index=-100, reduction="sum")
            count += int((labels >= 0).sum()) if d == 0 else 0
    return total / max(1, count)


ARMS = {"every anchor, per window, fused": ("every", True),
        "from first_anchor, per window, per-tensor": ("first", False),
        "from first_anchor, per window, fused": ("first", True),
        "from first_anchor, packed, fused": ("packed", True)}


def loss_of(way: str, batch: eagle_fit.Sequences, head: Eagle3Head,
            t2d: torch.Tensor) -> torch.Tensor:
    return (batch.loss(head, t2d) if way == "packed"
            else per_window(batch.shards, head, t2d, way == "every"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--windows", nargs="*", type=Path, default=[],
                        help="folders of a run's shards (default: two synthetic windows)")
    args = parser.parse_args()
    head = new_head()
    t2d = target_to_draft(head.draft_ids, V)
    if args.windows:
        pool = eagle_fit.load_windows(sorted(p for f in args.windows
                                             for p in f.glob("*.safetensors")))
        eagle_fit.scale_windows(pool, eagle_fit.input_scale(pool))
        gen = torch.Generator().manual_seed(1)
        draw = lambda: eagle_fit.Sequences(pool, DEPTHS).sample(gen, 512)  # noqa: E731
    else:
        fixed = eagle_fit.Sequences(synthetic_windows(head), DEPTHS)
        draw = lambda: fixed  # noqa: E731
    optims = {name: torch.optim.AdamW(head.parameters(), lr=1e-6, fused=fused)
              for name, (_, fused) in ARMS.items()}
    times, sizes = {name: [] for name in ARMS}, []
    for r in range(args.rounds + 2):
        batch = draw()
        sizes.append((len(batch), sum(s.aux.shape[0] for s in batch.shards)))
        for name, (way, _) in ARMS.items():
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                value = loss_of(way, batch, head, t2d)
            optims[name].zero_grad()
            value.backward()
            optims[name].step()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads; median of "
          f"{args.rounds} steps; windows, rows per batch: {sizes[2:]}")
    for name, ts in times.items():
        print(f"{name:>42}: {statistics.median(ts):.2f} s")
    with torch.no_grad():
        losses = {way: f"{float(loss_of(way, batch, head, t2d)):.6f}"
                  for way in ("every", "first", "packed")}
    print(f"loss of the last batch (float32): {losses}")


if __name__ == "__main__":
    main()
