"""Training a hidden-state head on self-distilled shards (train/data.py).

Unrolled draft steps ("training-time test"): from each answer position j the
head runs `depths` steps as it will when drafting, step d reading its own
feature of step d-1 (the target's state at d = 0) and the answer token
a_{j+d}, and is scored by cross-entropy on a_{j+d+1} (the target's own greedy
token), step d weighted DEPTH_DECAY**d. Tokens outside the draft vocabulary
are not scored (the head cannot draft them). The draft vocabulary is the
`draft_vocab_size` most frequent answer tokens (and the stop tokens).

Validation (shards held out): per-depth greedy acceptance along the chain,
accept[d] = P(steps 0..d all drafted the target's token), and the expected
accepted length at k = depths, tau = 1 + sum(accept) (the bonus token
included, as EAGLE's papers count it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.drafters.hidden_head import HeadConfig, HiddenStateHead
from specdecode.train.heap import HeapGuard

DEPTH_DECAY = 0.8


def draft_vocabulary(shards: Sequence[tuple[torch.Tensor, torch.Tensor]], size: int,
                     vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """[size] int64 target ids, sorted: `always` first, then by answer frequency
    (ties and unseen ids by id)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for tokens, _ in shards:
        counts += torch.bincount(tokens, minlength=vocab_size).double()
    counts[list(always)] = math.inf
    order = torch.argsort(-counts, stable=True)
    return torch.sort(order[:size]).values


@dataclass
class Windows:
    """Training windows: start j of each, with the tokens it reads and is scored on.

    hidden: [N, H] target states at the starts; tokens: [N, depths + 1] the answer
    tokens a_j .. a_{j+depths} (-1 past an answer's end)."""

    hidden: torch.Tensor
    tokens: torch.Tensor

    @staticmethod
    def of(shards: Sequence[tuple[torch.Tensor, torch.Tensor]], depths: int) -> Windows:
        hs, ts = [], []
        for tokens, hidden in shards:
            n = len(tokens)
            if n < 2:
                continue
            padded = torch.cat((tokens, torch.full((depths,), -1)))
            idx = torch.arange(n - 1)[:, None] + torch.arange(depths + 1)[None]
            hs.append(hidden[: n - 1])
            ts.append(padded[idx])
        return Windows(torch.cat(hs), torch.cat(ts))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def answer_tokens(self) -> int:
        """Training positions in this set (one per window)."""
        return len(self.tokens)

    def sample(self, gen: torch.Generator, batch: int) -> Windows:
        """`batch` windows drawn at random (with replacement)."""
        pick = torch.randint(len(self), (min(batch, len(self)),), generator=gen)
        return Windows(self.hidden[pick], self.tokens[pick])

    def loss(self, head: HiddenStateHead, t2d: torch.Tensor) -> torch.Tensor:
        return loss_of(head, t2d, self)

    def acceptance(self, head: HiddenStateHead) -> list[float]:
        return acceptance(head, self)


def unrolled_logits(head: HiddenStateHead, hidden: torch.Tensor,  # [B, H]
                    tokens: torch.Tensor,  # [B, depths + 1] int64 (-1: none)
                    ) -> list[torch.Tensor]:  # depths x [B, Vd]
    """Step d's logits (scoring tokens[:, d + 1]) for each depth, the head fed its
    own features and the true tokens, as when drafting."""
    feature, out = hidden, []
    for d in range(tokens.shape[1] - 1):
        feature, logits = head.step(feature, tokens[:, d].clamp(min=0))
        out.append(logits)
    return out


def target_to_draft(draft_ids: torch.Tensor,  # [Vd] int64 target ids
                    vocab_size: int) -> torch.Tensor:  # [vocab_size] int64
    """t2d: each target id's draft id (-100: not in the draft vocabulary)."""
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    return t2d


def _labels(t2d: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids (-100: outside the draft vocabulary or none)."""
    return torch.where(tokens >= 0, t2d[tokens.clamp(min=0)], -100)


def loss_of(head: HiddenStateHead, t2d: torch.Tensor, batch: Windows) -> torch.Tensor:
    logits = unrolled_logits(head, batch.hidden, batch.tokens)
    total = torch.zeros(())
    for d, row in enumerate(logits):
        labels = _labels(t2d, batch.tokens[:, d + 1])
        if (labels >= 0).any():
            total = total + DEPTH_DECAY ** d * torch.nn.functional.cross_entropy(
                row.float(), labels, ignore_index=-100)
    return total


@torch.no_grad()
def acceptance(head: HiddenStateHead, windows: Windows, batch: int = 1024) -> list[float]:
    """accept[d]: share of windows whose first d + 1 greedy draft steps all match."""
    hits = torch.zeros(windows.tokens.shape[1] - 1)
    for s in range(0, len(windows), batch):
        h, t = windows.hidden[s:s + batch], windows.tokens[s:s + batch]
        alive = torch.ones(len(t), dtype=torch.bool)
        for d, logits in enumerate(unrolled_logits(head, h, t)):
            alive &= head.draft_ids[logits.argmax(-1)] == t[:, d + 1]
            hits[d] += alive.sum()
    return (hits / max(1, len(windows))).tolist()


@dataclass
class TrainResult:
    """What a run did: steps, windows seen, and the validation curve
    (training windows seen -> accept per depth and tau)."""

    steps: int = 0
    seconds: float = 0.0
    curve: list[dict] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.curve[-1]["tau"] if self.curve else 1.0


def fit(head, train, val, *, steps: int, batch: int = 256, lr: float = 1e-3,
        evals: int = 5, seed: int = 0, minutes: float | None = None,
        autocast: torch.dtype | None = None,
        report: Callable[[dict], None] | None = None,
        on_step: Callable[[int, int, int], None] | None = None) -> TrainResult:
    """AdamW on the unrolled loss over `steps` random batches of `train`, with a
    cosine learning rate; the validation acceptance `evals` times along the way.
    train / val: Windows (a HiddenStateHead) or eagle_fit.Sequences (an Eagle3Head):
    `sample(gen, batch)`, `.loss(head, t2d)`, `.acceptance(head)`, `answer_tokens`.
    minutes: a time budget: `steps` is cut to what fits it, re-planned after every
    step (StepPlan; the schedule and the evaluations follow). autocast: the loss in
    that dtype on the head's device type (torch.autocast; the weights and the
    optimiser stay float32). on_step:
    called after each step with (step, steps planned now, answer tokens seen)."""
    t2d = target_to_draft(head.draft_ids, head.config.target_vocab_size)
    params = [p for p in head.parameters() if p.requires_grad]
    device = params[0].device.type
    # fused: one kernel per step for all parameters (3-5 % of an EAGLE-3 step
    # here: bench/train_step.py)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0,
                            fused=device in ("cpu", "cuda"))
    plan = StepPlan(steps, minutes, evals)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, plan.total) / max(1, plan.total))))
    gen, result = torch.Generator().manual_seed(seed), TrainResult()
    step, seen, heap = 0, 0, HeapGuard()
    head.train()
    while step < plan.total:
        step += 1
        sample = train.sample(gen, batch)
        with torch.autocast(device, dtype=autocast or torch.bfloat16,
                            enabled=autocast is not None):
            loss = sample.loss(head, t2d)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        seen += sample.answer_tokens
        last_loss = loss.item()
        del loss, sample
        heap.after_step()  # the step's tensors are freed now (train/heap.py)
        plan.after(step)
        if on_step:
            on_step(step, plan.total, seen)
        if plan.eval_due(step):
            result.curve.append(_evaluate(head, val, step, seen, last_loss, batch))
            heap.after_step()
            if report:
                report(result.curve[-1])
    head.eval()
    result.steps, result.seconds = plan.total, time.perf_counter() - plan.start
    return result


class StepPlan:
    """How many steps fit: `steps`, or under a time budget (minutes) what fits it.
    From step 3 on the count is re-planned after every step from the pace since
    step 3 (the first steps pay one-off costs, kernels and buffers: planned from
    them alone, a run with a 32k draft vocabulary planned ~500 steps, ~60 % of
    its budget at the pace it went on to keep); at least 4 steps. `evals`
    evaluations at even fractions of the plan as it stands, and always one at
    its final step."""

    def __init__(self, steps: int, minutes: float | None, evals: int) -> None:
        self.steps, self.total, self.evals, self.done = steps, steps, evals, 0
        self.start = time.perf_counter()
        self.deadline = None if minutes is None else self.start + 60 * minutes
        self.mark: tuple[int, float] | None = None  # (step 3, its time)

    def after(self, step: int) -> None:
        """Re-plan after `step` steps."""
        if self.deadline is None or step < 3:
            return
        now = time.perf_counter()
        if self.mark is None:
            self.mark = (step, now)
            pace = (now - self.start) / step
        else:
            pace = (now - self.mark[1]) / (step - self.mark[0])
        fits = step + int(max(0.0, self.deadline - now) / max(pace, 1e-9))
        self.total = min(self.steps, max(4, fits))

    def eval_due(self, step: int) -> bool:
        """Whether step reaches the next evaluation (several at once count once;
        none before a budgeted plan has its pace; the final step always)."""
        if self.deadline is not None and step <= 3 and step < self.total:
            return False
        due = False
        while self.done < self.evals and step * self.evals >= self.total * (self.done + 1):
            self.done, due = self.done + 1, True
        return due or step == self.total


def _evaluate(head, val, step: int, tokens: int, loss: float, batch: int) -> dict:
    """One point of the learning curve: validation acceptance per depth and tau after
    `tokens` answer tokens seen in training."""
    head.eval()
    acc = val.acceptance(head)
    head.train()
    return {"step": step, "windows": step * batch, "tokens": tokens, "loss": loss,
            "accept": acc, "tau": 1 + sum(acc)}


def new_head(embed: torch.Tensor,  # [V, H] the target's embedding table
             lm_head: torch.Tensor,  # [V, H] the target's output projection
             d2t: torch.Tensor,  # [Vd] int64
             intermediate_size: int | None = None, eps: float = 1e-6) -> HiddenStateHead:
    """A head initialised from the target (HiddenStateHead.init_from_target)."""
    v, h = embed.shape
    cfg = HeadConfig(h, intermediate_size or 2 * h, len(d2t), v, eps)
    head = HiddenStateHead(cfg, embed)
    head.init_from_target(lm_head, d2t)
    return head
