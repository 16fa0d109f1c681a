"""SpecStats: what one generation (or many, merged) did, in README.md's Metrics terms.

- steps: target verification passes (plain decoding: one per token).
- drafted: draft tokens proposed; accepted: draft tokens the verifier kept and
  that were emitted (tokens after a stop inside a draft do not count).
- acceptance_rate = accepted / drafted.
- mean_accepted_length (tau) = emitted tokens / steps, the recovered/bonus
  token included, so plain decoding has tau = 1.
- position_acceptance[i] = P(draft token i accepted | tokens < i accepted).
- cached_tokens: prompt tokens whose keys/values the target's cache already held
  (an earlier request's prefix, reused instead of prefilled).
- guard_plain_steps: steps made plain by the acceptance-collapse guard
  (collapse.py); guard_engagements: times it engaged during the run;
  speculation_paused: it was engaged at the run's last step (speculation off).
- drafter_errors: drafters that raised and were switched off for the rest of
  their request (engine.py); the request went on without them.
- times: prefill, draft, verify (target pass + verification), other
  (stop checks and bookkeeping); wall time of the whole call.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    position_tried: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    drafter_steps: dict[str, int] = field(default_factory=dict)  # steps that verified its draft
    cached_tokens: int = 0
    guard_plain_steps: int = 0
    guard_engagements: int = 0
    speculation_paused: bool = False
    drafter_errors: int = 0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    other_time: float = 0.0
    wall_time: float = 0.0

    def record_step(self, drafted: int, accepted: int, emitted: int, tried: int,
                    drafter: str | None = None) -> None:
        """One verification pass.

        drafted: tokens in the draft; accepted: draft tokens kept and emitted;
        emitted: tokens emitted (accepted + the recovered/bonus token, fewer if
        a stop cut the step); tried: draft positions the verifier decided on
        (accepted + the rejected one, if any and it was reached); drafter: the
        name of the drafter whose draft it verified (None: no draft).
        """
        if drafter is not None:
            self.drafter_steps[drafter] = self.drafter_steps.get(drafter, 0) + 1
        assert accepted <= tried <= drafted and accepted <= emitted
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.accepted_per_step.append(accepted)
        self.drafted_per_step.append(drafted)
        grow = tried - len(self.position_tried)
        if grow > 0:
            self.position_tried += [0] * grow
            self.position_accepted += [0] * grow
        for i in range(tried):
            self.position_tried[i] += 1
            self.position_accepted[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.position_accepted, self.position_tried)]

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens over decode time (prefill excluded)."""
        return self.emitted / self.decode_time if self.decode_time > 0 else 0.0

    def merge(self, other: SpecStats) -> SpecStats:
        """Sum of two runs (for per-workload totals)."""
        out = SpecStats()
        for name in ("steps", "drafted", "accepted", "emitted", "cached_tokens",
                     "guard_plain_steps", "guard_engagements", "drafter_errors",
                     "prefill_time", "draft_time",
                     "verify_time", "other_time", "wall_time"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.speculation_paused = other.speculation_paused  # the later run's state
        out.accepted_per_step = self.accepted_per_step + other.accepted_per_step
        out.drafted_per_step = self.drafted_per_step + other.drafted_per_step
        out.drafter_steps = {name: self.drafter_steps.get(name, 0) + other.drafter_steps.get(
            name, 0) for name in {**self.drafter_steps, **other.drafter_steps}}
        n = max(len(self.position_tried), len(other.position_tried))
        for mine, theirs, dst in (
            (self.position_tried, other.position_tried, out.position_tried),
            (self.position_accepted, other.position_accepted, out.position_accepted),
        ):
            dst.extend((mine[i] if i < len(mine) else 0) + (theirs[i] if i < len(theirs) else 0)
                       for i in range(n))
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "position_acceptance": self.position_acceptance,
            "drafter_steps": dict(self.drafter_steps),
            "cached_tokens": self.cached_tokens,
            "guard_plain_steps": self.guard_plain_steps,
            "guard_engagements": self.guard_engagements,
            "speculation_paused": self.speculation_paused,
            "drafter_errors": self.drafter_errors,
            "prefill_time": self.prefill_time,
            "draft_time": self.draft_time,
            "verify_time": self.verify_time,
            "other_time": self.other_time,
            "wall_time": self.wall_time,
            "tokens_per_second": self.tokens_per_second,
        }
