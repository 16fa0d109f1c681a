"""Adaptive speculation length: draft only as many tokens as pay for their verification.

A step that verifies L draft tokens costs c(L + 1) + L * c_draft plain steps
(c: the target's measured forward cost curve, c(1) = 1; c_draft: one draft
token) and emits 1 + A(L) tokens on average, where

    A(L) = sum_{i=1..L} prod_{j=1..i} a_j

and a_j is the acceptance rate at draft position j given that positions
1..j-1 were accepted. Before each step the policy picks the L that maximises
tokens per unit of cost; L = 0 (plain decoding, rate 1) wins whenever no L >= 1
beats it. On a GPU, or the PyTorch CPU path with AMX, c is nearly flat and L
stays at k; on llama.cpp's CPU path c(2..8) costs almost b plain steps, so
short drafts rarely pay and long ones only at high acceptance.

The a_j are running estimates: (accepted, tried) counts, decayed by `decay`
at each step that observes their position, starting from a prior; a step
without a draft relaxes them towards the prior. Positions from `pool_from` on
share one estimate. Where drafting is free (n-gram lookup) every proposal is
judged in hindsight, position by position as the generated text reaches it
(`watch` / `resolve`): a draft cut to 0 tokens still teaches the policy
whether it would have been accepted, so a good stretch after a bad one is
found without paying for a verification. (A point-mass draft token x is
accepted with probability p(x), the same as the chance that the sampled token
is x: hindsight agreement has the acceptance's expectation when sampling
too.) A free draft's pooled positions are priced at a lower confidence bound
of their estimate (`LengthPolicy.priced`): a few confirmed positions are
little evidence for a long draft. Drafts that cost (a draft model) are judged
by their verification only. Truncating a draft never changes what is
emitted, only how much of it one step can accept: the policy is lossless.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields


@dataclass
class CostModel:
    """Step costs in plain target steps.

    verify: c(b) for the measured batch sizes b (1 included), in any unit (kept
        relative to c(1)); sizes in between are interpolated linearly, sizes
        past the last extrapolate its slope.
    draft_per_token: cost of proposing one draft token (0 for n-gram lookup).
    catchup_per_token: cost of each context token a draft model feeds beyond
        one before its first draft token (None: a quarter of draft_per_token,
        batched feeding being cheaper per token than one-token steps).
    step_seconds: what c(1) was in the unit of `verify` (None: that value):
        the absolute time of one plain step, for comparing with observed steps.
    """

    verify: Mapping[int, float]
    draft_per_token: float = 0.0
    catchup_per_token: float | None = None
    step_seconds: float | None = None

    def __post_init__(self) -> None:
        if 1 not in self.verify:
            raise ValueError("the cost curve needs c(1), one plain step")
        base = self.verify[1]
        if self.step_seconds is None:
            self.step_seconds = base
        if self.catchup_per_token is None:
            self.catchup_per_token = self.draft_per_token / 4
        self.verify = {b: c / base for b, c in sorted(self.verify.items())}

    @classmethod
    def flat(cls) -> CostModel:
        """Verification as cheap as a plain step at any size (an idealised GPU)."""
        return cls({1: 1.0, 2: 1.0})

    def c(self, b: int) -> float:
        """Cost of one target pass over b tokens, in plain steps (memoised: the decision
        of every step asks for dozens of sizes)."""
        table = self.__dict__.setdefault("_table", {})
        if b not in table:
            table[b] = self._interpolate(b)
        return table[b]

    def _interpolate(self, b: int) -> float:
        sizes = list(self.verify)
        if b in self.verify:
            return self.verify[b]
        lo = max((s for s in sizes if s < b), default=sizes[0])
        hi = min((s for s in sizes if s > b), default=None)
        if hi is None:  # extrapolate the last segment's slope
            lo, hi = sizes[-2], sizes[-1]
        slope = (self.verify[hi] - self.verify[lo]) / (hi - lo)
        return max(self.verify[lo] + slope * (b - lo), 0.0)


def best_length(
    costs: CostModel, acceptance: list[float], k: int, *, drafted: bool = False,
    overhead: float = 0.0,
) -> tuple[int, float]:
    """(L, tokens per plain-step cost) maximising the expected rate over L = 0..k.

    acceptance[j - 1] = a_j, the conditional acceptance at position j.
    drafted: the k tokens are already drafted, so their cost is spent and only
    verification counts. overhead: a cost every L >= 1 pays once (a draft
    model's catch-up on context it has not seen), in plain steps."""
    per_draft = 0.0 if drafted else costs.draft_per_token
    best, best_rate = 0, 1.0 / costs.c(1)
    expected, survive = 1.0, 1.0
    for length in range(1, k + 1):
        survive *= acceptance[length - 1] if length <= len(acceptance) else 0.0
        expected += survive
        # A step costs something: an online curve whose observed passes timed ~0 s
        # (seen once, in test_cli's compare-plain run: ZeroDivisionError) must not crash.
        rate = expected / max(costs.c(length + 1) + length * per_draft + overhead, 1e-9)
        if rate > best_rate + 1e-9:
            best, best_rate = length, rate
    return best, best_rate


def rate_at(costs: CostModel, acceptance: list[float], length: int, *,
            drafted: bool = False, overhead: float = 0.0) -> float:
    """Expected tokens per plain-step cost of verifying exactly `length` draft tokens
    (the rate `best_length` maximises over lengths)."""
    if length == 0:
        return 1.0 / costs.c(1)
    expected, survive = 1.0, 1.0
    for j in range(length):
        survive *= acceptance[j] if j < len(acceptance) else 0.0
        expected += survive
    per_draft = 0.0 if drafted else costs.draft_per_token
    return expected / (costs.c(length + 1) + length * per_draft + overhead)


def wilson_lower(accepted: float, tried: float, z: float) -> float:
    """The Wilson score interval's lower end for a rate seen as `accepted` of `tried`
    (decayed counts: fractions are fine), z standard deviations below; 0 when
    nothing was tried. It tends to accepted / tried as the counts grow."""
    if tried <= 0:
        return 0.0
    p, zz = accepted / tried, z * z
    centre = p + zz / (2 * tried)
    margin = z * math.sqrt(max(p * (1 - p), 0.0) / tried + zz / (4 * tried * tried))
    return max(0.0, (centre - margin) / (1 + zz / tried))


@dataclass
class LengthPolicy:
    """Chooses each step's draft length from the cost model and the acceptance it sees.

    prior: (accepted, tried) pseudo-counts every estimate starts with: optimistic
        (0.9) and weak (2 observations), so drafts are tried early and judged fast
        (replaying measured outputs: +5-10 % over (3, 4) on llama.cpp's curve, with
        point estimates; free drafts' pooled positions are priced lower, `priced`).
    decay: weight kept by old counts at each step that adds to them (recent text
        matters).
    pool_from: positions from this one on share one estimate (the chance that a
        draft that has been right so far stays right): drafts of 64 tokens are
        judged after a few steps, not after 64 observations of position 64.
    carry_over: a new request starts from the last request's estimates where they
        are below the prior's, at the prior's weak strength (`begin`).
    caution: z of the lower bound that prices a free draft's pooled positions
        (`priced`; 0: the estimate itself; >= 0). 0.5 was chosen by replaying 38
        recorded answers on four measured cost curves
        (bench/llama_cpp/prior_replay.py --caution, bench/results/caution-replay.md):
        on the steepest (c(2) 2.25) no answer below 0.98x plain instead of 3
        (worst 1.00x vs 0.91x); the price is up to -3 % on HumanEval and -7 % on
        long copies (random-text prompts), where long drafts wait for evidence.
    """

    costs: CostModel
    prior: tuple[float, float] = (1.8, 2.0)
    decay: float = 0.95
    pool_from: int = 2
    carry_over: bool = False
    caution: float = 0.5
    _accepted: list[float] = field(default_factory=list)
    _tried: list[float] = field(default_factory=list)
    _watched: list[list] = field(default_factory=list)  # [start, tokens, judged]

    def __post_init__(self) -> None:
        if self.pool_from < 1:
            raise ValueError("pool_from must be >= 1")
        if self.caution < 0:
            raise ValueError("caution must be >= 0")
        self.begin()

    def begin(self, last: list[float] | None = None) -> None:
        """A new request: estimates back to the prior, nothing watched. Requests
        differ (an editing request copies, the next one may not): carried over,
        a copy's pooled estimate (hundreds of decayed observations near 1.0) kept
        drafting ~5 tokens a step at 4 % acceptance on a random prompt (0.58x).
        With carry_over only the pessimistic direction is carried, and weakly:
        each estimate starts at min(prior, last estimate) with the prior's two
        observations, so a kind of free draft that was junk (1-token n-gram
        matches in chat) is not verified again at 90 % by every request, and
        one that pays is back at the prior after a step or two of hindsight.
        last: the estimates to carry (default: this policy's own)."""
        mean, weight = self.prior[0] / self.prior[1], self.prior[1]
        if last is None:
            last = self.acceptance(self.pool_from) if self.carry_over and self._tried else []
        means = [min(mean, a) for a in last] if self.carry_over and last else []
        means = means or [mean] * self.pool_from
        self._accepted = [m * weight for m in means]
        self._tried = [weight] * self.pool_from
        self._watched = []

    def anew(self, **changes: object) -> LengthPolicy:
        """A new policy with this one's settings (every public field) but `changes`,
        its estimates at their prior: what a request or a fresh controller starts
        from, so a setting added here is carried without naming it."""
        settings = {f.name: getattr(self, f.name) for f in fields(self)
                    if not f.name.startswith("_")}
        return LengthPolicy(**{**settings, **changes})

    def acceptance(self, k: int) -> list[float]:
        """Current a_1..a_k estimates."""
        rates = [a / t for a, t in zip(self._accepted, self._tried, strict=True)]
        return [rates[min(j, self.pool_from - 1)] for j in range(k)]

    def priced(self, k: int) -> list[float]:
        """a_1..a_k to price a free draft with: `acceptance`, except that the pooled
        positions (pool_from on) take the Wilson lower bound (z = caution) of their
        counts, never above the estimate itself. A few confirmed positions (one
        lookup match continuing for 3-4 tokens) raise the pooled estimate to ~95 %
        with a weight of ~4 observations, which on a steep curve (c(21) ~10.5 plain
        steps) prices a 20-token draft above plain; the bound asks for 7. The prior's
        pseudo-counts are bounded too: a fresh pooled position (0.9 from 2) is priced
        at 0.75."""
        rates = self.acceptance(k)
        if self.caution <= 0 or k < self.pool_from:
            return rates
        pooled = self.pool_from - 1
        low = wilson_lower(self._accepted[pooled], self._tried[pooled], self.caution)
        return rates[:pooled] + [min(low, rates[pooled])] * (k - pooled)

    def length(self, k: int, *, drafted: bool = False) -> int:
        """Draft length for this step, at most k. drafted: the drafter already
        proposed k tokens (cut them; their drafting cost is spent); otherwise the
        answer is how many to ask a drafter for that pays per token."""
        return best_length(self.costs, self.acceptance(k), k, drafted=drafted)[0]

    def observe(self, tried: int, accepted: int) -> None:
        """A step verified `tried` draft tokens and accepted the first `accepted`
        (tried = 0: a step without a draft, which relaxes every estimate towards
        the prior so that a drafter cut off after a bad stretch is tried again)."""
        if tried == 0:
            d = self.decay
            for j in range(self.pool_from):
                self._tried[j] = d * self._tried[j] + (1 - d) * self.prior[1]
                self._accepted[j] = d * self._accepted[j] + (1 - d) * self.prior[0]
            return
        events = [[0, 0] for _ in range(self.pool_from)]
        self._count(events, 0, accepted, rejected=accepted < tried)
        self._update(events)

    def watch(self, start: int, tokens: list[int]) -> None:
        """A proposal for the tokens at sequence positions start, start + 1, ..."""
        if tokens:
            self._watched.append([start, list(tokens), 0])

    def resolve(self, sequence: list[int]) -> None:
        """Judge the positions of watched proposals that `sequence` (the accepted
        tokens so far) now confirms or contradicts; a proposal stays watched until
        its first wrong token or its end is known."""
        events = [[0, 0] for _ in range(self.pool_from)]
        waiting = []
        for entry in self._watched:
            start, tokens, judged = entry
            known = sequence[start + judged:start + len(tokens)]
            agree = next((i for i, (a, b) in enumerate(zip(tokens[judged:], known))
                          if a != b), None)
            if agree is None:
                self._count(events, judged, judged + len(known), rejected=False)
                entry[2] = judged + len(known)
                if entry[2] < len(tokens):
                    waiting.append(entry)
            else:
                self._count(events, judged, judged + agree, rejected=True)
        self._watched = waiting
        self._update(events)

    def _count(self, events: list[list[int]], first: int, end: int, rejected: bool) -> None:
        """Positions first..end-1 accepted, and position `end` rejected if `rejected`."""
        for j in range(first, end + rejected):
            slot = events[min(j, self.pool_from - 1)]
            slot[0] += 1
            slot[1] += j < end

    def _update(self, events: list[list[int]]) -> None:
        """One decay per slot that saw anything, then add what it saw."""
        for j, (tried, accepted) in enumerate(events):
            if tried:
                self._tried[j] = self.decay * self._tried[j] + tried
                self._accepted[j] = self.decay * self._accepted[j] + accepted

    def describe(self, k: int) -> str:
        """One line: the best length now and its predicted speed-up."""
        length, rate = best_length(self.costs, self.acceptance(k), k)
        return f"draft length {length} of {k} (predicted {rate:.2f}x plain steps)"
