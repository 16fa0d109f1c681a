"""Closed-loop control of speculation: which drafter and how many draft tokens, per step.

The engine asks `Controller.plan` for each step's draft and reports back with
`Controller.observe` (tokens accepted, seconds spent drafting and verifying).
The decision per step maximises expected emitted tokens per unit of cost
(speclen.best_length) over the options it has:

- plain: one target step, rate 1;
- each free drafter (n-gram lookup): it proposes, the draft is cut to the
  length that pays for its verification; its acceptance is judged in
  hindsight (speclen.LengthPolicy.watch / resolve), so it costs nothing to
  keep its estimates current; its pooled positions (past the first) are
  priced at a lower bound of their estimate (speclen.LengthPolicy.priced), so
  a long draft needs more than a few confirmed positions;
- each costly drafter (a draft model), unless paused: priced before paying,
  with its per-token cost and the catch-up of tokens it has not seen (the
  draft model feeds the context it missed before its first draft token).

Costs come from `OnlineCosts`: the start-up curve c(b) is only the prior; the
wall time of every verification pass, draft token and catch-up is recorded
per context-length band and batch-size bucket, and medians of recent
observations correct the prior (robust to single spikes). A disturbed or
busy machine therefore changes the decisions as soon as steps disagree with
the prediction; observations expire after HORIZON passes, so a load that has
gone stops counting. A costly drafter starts with a one-token probe; a
rejected probe, or recent steps of its own whose emitted tokens did not pay
for their observed seconds, pause it (no proposals, no catch-up) for 16, 64,
256, ... steps, after which it is probed again from its optimistic prior.
Pauses outlive requests (a drafter that does not pay for this pair on this
machine is not re-tried at full length by every request); acceptance
estimates belong to the request (`Control`, from `Controller.begin`), per
drafter and kind of draft (Draft.kind), and only a kind's pessimistic
estimates are carried to the next request (speclen.LengthPolicy.begin).

A run of steps where nothing pays engages the acceptance-collapse guard
(collapse.py, `Controller.guard`): speculation off, plain steps with a probe
now and then, reported in the stats (`guard_plain_steps`, `speculation_paused`).
A drafter that raised during a request (`Control.failed`, engine.py) is left
out of that request's plans.

Nothing here changes what is emitted: the controller only chooses the draft
the verifier sees, and every verifier is lossless for any draft.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdecode.collapse import CollapseGuard
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.speclen import CostModel, LengthPolicy, best_length, rate_at

ProposeFn = Callable[[Drafter, DraftContext], Draft]
"""(drafter, context) -> the drafter's draft of at most context.k tokens (stops applied)."""

MIN_OBSERVATIONS = 3  # a median of fewer is not trusted over the prior
HORIZON = 512  # passes after which an observation of a pass no longer counts
PLAIN_EVERY = 64  # passes without a plain one after which a step is plain (to measure it)
MEASURE_BELOW = 1.5  # ...unless the best draft is free and predicted to gain this much
REFRESH = 4  # observations after which the cost model is rebuilt
EXPLORE_WITHIN = 0.7  # a free draft is verified longer to measure a new size within this rate
FIRST_PAUSE, PAUSE_GROWTH, MAX_PAUSE = 16, 4, 1024  # steps a non-paying drafter sits out


def size_bucket(b: int) -> int:
    """Batch-size bucket: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, 9-16 -> 4, ..."""
    return (b - 1).bit_length()


def context_band(length: int) -> int:
    """Context-length band: < 256 -> 0, 256-511 -> 1, 512-1023 -> 2, ..."""
    return (length // 256).bit_length()


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if len(values) >= MIN_OBSERVATIONS else None


class OnlineCosts:
    """Step costs of this process's target and draft model, learnt from every step.

    prior: the start-up cost curve (relative c(b), c_draft, catch-up);
        prior.step_seconds is what one plain step took then (any unit, as long
        as observations use the same clock).

    Each verification pass over b tokens at context length n is stored as the
    plain-step time it implies, seconds / prior.c(b), in its (band(n),
    bucket(b)) window of the last WINDOW observations. c(b) now = prior.c(b) *
    ratio(b), where ratio(b) is the median implied time of b's bucket over the
    median plain step (bucket 0) of the same band (or of the nearest band with
    plain steps; none: prior.step_seconds); a bucket never observed takes the
    ratio of the nearest observed one; nothing observed: the prior. Draft
    tokens and catch-up tokens have windows of their own, priced against the
    same plain step. Plain passes are asked for (`needs_plain`) while a band has
    too few and every PLAIN_EVERY passes. Machine-level state: it outlives
    requests.
    """

    WINDOW = 9

    def __init__(self, prior: CostModel) -> None:
        self.prior = prior
        self._count = 0  # passes observed so far: the age of an observation
        self._last_plain = 0  # the pass number of the last plain (one-token) pass
        self._passes: dict[tuple[int, int], deque] = {}  # -> (pass number, implied seconds)
        self._draft: deque = deque(maxlen=self.WINDOW)  # seconds per draft token
        self._catchup: deque = deque(maxlen=self.WINDOW)  # seconds per caught-up token
        self._seen = 0  # observations of any kind so far
        self._model: tuple[int, int, CostModel] | None = None  # (band, _seen, model) cached

    def observe_pass(self, b: int, seconds: float, context_len: int) -> None:
        """A target pass over b new tokens after context_len cached ones took `seconds`."""
        key = (context_band(context_len), size_bucket(b))
        window = self._passes.setdefault(key, deque(maxlen=self.WINDOW))
        self._count += 1
        self._seen += 1
        if b == 1:
            self._last_plain = self._count
        window.append((self._count, seconds / self.prior.c(b)))

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """`tokens` one-token forwards of the draft model took `seconds` in all."""
        if tokens > 0:
            self._draft.append(seconds / tokens)
            self._seen += 1

    def observe_catchup(self, tokens: int, seconds: float) -> None:
        """The draft model fed `tokens` extra context tokens (beyond one) in `seconds`."""
        if tokens > 0:
            self._catchup.append(seconds / tokens)
            self._seen += 1

    def _median_at(self, band: int, bucket: int) -> float | None:
        """Median implied plain-step seconds of the recent passes of (band, bucket)."""
        fresh = self._count - HORIZON
        return _median([v for n, v in self._passes.get((band, bucket), ()) if n > fresh])

    def _nearest_band(self, band: int, bucket: int) -> int | None:
        """The band nearest to `band` with enough recent passes of `bucket` (None: none)."""
        bands = [x for x, j in self._passes if j == bucket and self._median_at(x, j)]
        return min(bands, key=lambda x: (abs(x - band), x)) if bands else None

    def _nearest(self, band: int, bucket: int) -> float | None:
        """The median of `bucket` in the band nearest to `band` that has enough of it."""
        near = self._nearest_band(band, bucket)
        return None if near is None else self._median_at(near, bucket)

    def needs_plain(self, context_len: int) -> bool:
        """Whether a plain pass should be measured now: the band of this context has
        fewer than MIN_OBSERVATIONS recent ones, or none came for PLAIN_EVERY passes.
        Without them every cost is judged against the start-up step, which a busy
        machine at load time can have made look slow (drafts then look cheap)."""
        since = self._count - self._last_plain
        fresh = self._count - HORIZON
        plain = [n for n, _ in self._passes.get((context_band(context_len), 0), ()) if n > fresh]
        return since >= PLAIN_EVERY or (len(plain) < MIN_OBSERVATIONS and since >= 2)

    def observed(self, b: int, context_len: int) -> bool:
        """Whether passes of b's bucket have been measured recently at this context band."""
        return self._median_at(context_band(context_len), size_bucket(b)) is not None

    def _plain_at(self, band: int) -> float:
        """Implied plain-step seconds near `band`: plain passes of the nearest band that
        has enough; else the prior's own step."""
        return self._nearest(band, 0) or self.prior.step_seconds

    def plain_seconds(self, context_len: int) -> float:
        """Seconds of one plain step now, near this context length."""
        return self._plain_at(context_band(context_len))

    def ratio(self, b: int, context_len: int) -> float:
        """Observed over predicted cost of a b-token pass, relative to a plain step."""
        bucket = size_bucket(b)
        observed = {j for x, j in self._passes if j > 0 and self._median_at(x, j)}
        if bucket == 0 or not observed:
            return 1.0
        nearest = min(observed, key=lambda j: (abs(j - bucket), -j))
        band = self._nearest_band(context_band(context_len), nearest)
        return self._median_at(band, nearest) / self._plain_at(band)

    def model(self, context_len: int) -> CostModel:
        """The cost model to decide with now, in plain steps (c(1) = 1); rebuilt after
        REFRESH new observations or in another context band (building it takes ~1 ms,
        over 1 % of a plain step here)."""
        key = context_band(context_len)
        if self._model is None or self._model[0] != key or self._seen - self._model[1] >= (
                REFRESH):
            self._model = (key, self._seen, self._build(context_len))
        return self._model[2]

    def _build(self, context_len: int) -> CostModel:
        prior, plain = self.prior, self.plain_seconds(context_len)
        ratios: dict[int, float] = {}  # per bucket: its sizes share one ratio
        curve = {}
        for b in prior.verify:
            bucket = size_bucket(b)
            if bucket not in ratios:
                ratios[bucket] = self.ratio(b, context_len)
            curve[b] = prior.c(b) * ratios[bucket]
        draft, catchup = _median(self._draft), _median(self._catchup)
        return CostModel(
            curve, prior.draft_per_token if draft is None else draft / plain,
            catchup_per_token=prior.catchup_per_token if catchup is None else catchup / plain,
            step_seconds=plain)


@dataclass
class Slot:
    """One drafter under control: its policy settings and, if costly, its pause state.

    `policy` is the template of each request's estimates (its costs, prior,
    decay); requests get their own (`Control`). A costly slot's `recent` holds
    (tokens emitted, cost in plain steps) of its last few verified steps
    (cleared at a pause): what it realised, judged against plain steps (1).
    `kind_priors` start some kinds of draft elsewhere than `policy`'s prior.
    Machine-level, shared by requests: pauses, `recent`, `carried`. prices_catchup
    False: a costly draft is priced without the catch-up on context it has not
    seen (the fixed-k default's drafter keeps up as fixed k did: llm.py
    guarded_controller); its observed cost, catch-up included, still counts."""

    drafter: Drafter
    policy: LengthPolicy
    costly: bool  # drafting costs (decide before paying) vs free (judge in hindsight)
    failures: int = 0  # pauses in a row without a stretch that paid in between
    paused: int = 0  # steps left before the next probe
    probing: bool = True  # a costly slot's next draft is a one-token probe
    recent: deque = field(default_factory=lambda: deque(maxlen=3))
    carried: dict[int, list[float]] = field(default_factory=dict)  # kind -> last estimates
    epoch: int = 0  # probes started so far: a request's estimates restart at a new one
    prices_catchup: bool = True  # a costly draft's price includes its context catch-up
    kind_priors: dict[int, tuple[float, float]] | None = None  # kind -> (accepted,
    # tried) prior of its estimates; None: the drafter's `kind_priors` (drafters/base.py
    # MATCH_PRIORS for lookups), else none; kinds not named start at policy.prior

    def __post_init__(self) -> None:
        if self.kind_priors is None:
            self.kind_priors = dict(getattr(self.drafter, "kind_priors", {}))

    @property
    def name(self) -> str:
        return getattr(self.drafter, "name", type(self.drafter).__name__)

    def fresh_policy(self, kind: int) -> LengthPolicy:
        """A request's estimates of one kind of draft: kind 0 from the prior; other
        kinds from their own prior (kind_priors, else the policy's) and carry over
        the last request's pessimistic estimates (carry_over)."""
        p = self.policy
        prior = self.kind_priors.get(kind, p.prior)
        policy = p.anew(prior=prior, carry_over=kind > 0)
        if kind in self.carried:
            policy.begin(self.carried[kind])
        return policy

    def pause(self) -> None:
        """Sit out FIRST_PAUSE steps, PAUSE_GROWTH times longer at each pause in a row."""
        self.failures += 1
        self.paused = min(FIRST_PAUSE * PAUSE_GROWTH ** (self.failures - 1), MAX_PAUSE)
        self.recent.clear()

    def tick(self) -> bool:
        """One step passes; whether the slot is available for this step."""
        if self.paused > 0:
            self.paused -= 1
            if self.paused == 0:  # probe again, from the optimistic prior
                self.epoch += 1
                self.probing = True
            return False
        return True


class Control:
    """One request's side of a controller: acceptance estimates per slot and kind.

    From `Controller.begin`; `finish` hands the carried estimates back to the
    slots. Two requests interleaved step by step each keep their own."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        self.slots = list(slots)
        self._policies: list[dict[int, LengthPolicy]] = [{} for _ in self.slots]
        self._epochs = [slot.epoch for slot in self.slots]
        self.failed: set[int] = set()  # slots whose drafter raised in this request

    def policy(self, i: int, kind: int = 0) -> LengthPolicy:
        """The estimates of slot i's drafts of this kind (made on first use). Kind 0
        pools every draft of the slot; a kind first seen mid-request starts from the
        pooled estimates where they are lower than its own start (drafts that
        were all wrong so far make a new kind's first draft look no better)."""
        if self._epochs[i] != self.slots[i].epoch:  # a paused drafter is probed anew
            self._policies[i], self._epochs[i] = {}, self.slots[i].epoch
        table = self._policies[i]
        if kind not in table:
            table[kind] = self.slots[i].fresh_policy(kind)
            if kind and 0 in table:
                policy = table[kind]
                pooled = table[0].acceptance(policy.pool_from)
                own = policy.acceptance(policy.pool_from)
                policy.begin([min(a, b) for a, b in zip(own, pooled, strict=True)])
        return table[kind]

    def policies(self, i: int) -> list[LengthPolicy]:
        return list(self._policies[i].values())

    def finish(self) -> None:
        """The request ended: each kind that carries over leaves its estimates."""
        for slot, table in zip(self.slots, self._policies, strict=True):
            for kind, policy in table.items():
                if policy.carry_over:
                    slot.carried[kind] = policy.acceptance(policy.pool_from)


@dataclass
class Plan:
    """This step's draft and where it came from (slot None: a plain step)."""

    draft: Draft
    slot: Slot | None = None
    costs: CostModel | None = None
    length: int = 0  # a costly drafter's length to ask for (0: the draft is final)
    k: int = 0  # the most the step could have drafted
    policy: LengthPolicy | None = None  # the estimates the draft was priced with
    guarded: bool = False  # plain because the collapse guard is engaged (collapse.py)


class Controller:
    """Chooses each step's drafter and draft length; see the module doc.

    slots: the drafters it may use (free ones first is not required).
    prior: the start-up cost model. online: learn costs from observed steps
        (False: decide with the prior alone, deterministic: for replays).
    """

    def __init__(self, slots: Sequence[Slot], prior: CostModel, *, online: bool = True) -> None:
        if not slots:
            raise ValueError("a controller needs at least one drafter")
        self.slots, self.prior = list(slots), prior
        self.costs = OnlineCosts(prior) if online else None
        self.guard = CollapseGuard()

    @classmethod
    def single(cls, drafter: Drafter, policy: LengthPolicy, *, online: bool = False
               ) -> Controller:
        """One drafter with its policy; costly when the policy's costs price drafting."""
        return cls([Slot(drafter, policy, policy.costs.draft_per_token > 0)], policy.costs,
                   online=online)

    @property
    def drafters(self) -> list[Drafter]:
        return [slot.drafter for slot in self.slots]

    def begin(self) -> Control:
        """A new request's control: acceptance estimates from their priors (and the
        pessimistic carry-over); learnt costs and pauses are the controller's (they
        are about the machine and the pair, not the request)."""
        return Control(self.slots)

    def cost_model(self, context_len: int) -> CostModel:
        return self.prior if self.costs is None else self.costs.model(context_len)

    def plan(self, control: Control, ctx: DraftContext, propose: ProposeFn) -> Plan:
        """The draft for the step after ctx.tokens (at most ctx.k tokens; may be empty)."""
        context, k = ctx.tokens, ctx.k
        costs = self.cost_model(len(context))
        best, best_rate = Plan(Draft.empty(), None, costs, 0, k), 1.0
        if k <= 0:
            return best
        if not self.guard.probe_now():  # speculation off: plain, pauses still count down
            for i, slot in enumerate(self.slots):
                if slot.costly and i not in control.failed:
                    slot.tick()
            best.guarded = True
            return best
        judged = False  # some drafter had an option this step (priced, or a draft cut)
        for i, slot in enumerate(self.slots):
            if i in control.failed:
                continue
            if slot.costly:
                option, rate = self._costly_option(control, i, context, k, costs)
                judged = True
            else:
                option, rate, drafted = self._free_option(control, i, ctx, costs, propose)
                judged = judged or drafted > 0
            if option.length + len(option.draft) and rate > best_rate + 1e-9:
                best, best_rate = option, rate
        if best.slot is None and judged:
            self.guard.below()
        if self._measure_plain(best, best_rate, len(context)):
            return Plan(Draft.empty(), None, costs, 0, k)
        if best.length:  # a costly drafter won: now pay for its draft
            best.draft = propose(best.slot.drafter, ctx.with_k(best.length))
        return best

    def _costly_option(self, control: Control, i: int, context: list[int], k: int,
                       costs: CostModel) -> tuple[Plan, float]:
        """(option, rate) of slot i's costly drafter: priced, not yet asked."""
        slot, policy = self.slots[i], control.policy(i)
        policy.costs = costs
        length, rate = self._price_costly(slot, policy, context, k, costs)
        return Plan(Draft.empty(), slot, costs, length, k, policy), rate

    def _free_option(self, control: Control, i: int, ctx: DraftContext, costs: CostModel,
                     propose: ProposeFn) -> tuple[Plan, float, int]:
        """(option, rate, drafted) of slot i's free drafter: its draft (of `drafted`
        tokens), judged in hindsight and cut to the length that pays."""
        context, slot = ctx.tokens, self.slots[i]
        for policy in control.policies(i):
            policy.resolve(context)
        pooled = control.policy(i)
        draft = propose(slot.drafter, ctx)
        policy = control.policy(i, draft.kind)
        policy.costs = costs
        for watcher in [pooled] if policy is pooled else [pooled, policy]:
            watcher.watch(len(context), draft.tokens.tolist())
        length, rate = self._price_free(policy, draft, costs, len(context))
        return Plan(draft.truncate(length), slot, costs, 0, ctx.k, policy), rate, len(draft)

    def _price_free(self, policy: LengthPolicy, draft: Draft, costs: CostModel,
                    context_len: int) -> tuple[int, float]:
        """(length, rate) to verify of a free draft, priced with the policy's cautious
        estimates (speclen.LengthPolicy.priced). Where a longer cut would reach a
        batch-size bucket not yet observed at this context and is predicted to keep
        EXPLORE_WITHIN of the best rate, that longer cut is taken, so the costs of
        long batches are measured instead of believed (the start-up curve can
        overprice them, and a size never verified would never be corrected)."""
        acceptance = policy.priced(len(draft))
        length, rate = best_length(costs, acceptance, len(draft), drafted=True)
        longer = min(len(draft), 2 * length + 1)
        if self.costs is None or not length or longer <= length or self.costs.observed(
                longer + 1, context_len):
            return length, rate
        longer_rate = rate_at(costs, acceptance, longer, drafted=True)
        return (longer, longer_rate) if longer_rate >= EXPLORE_WITHIN * rate else (length, rate)

    def _measure_plain(self, best: Plan, rate: float, context_len: int) -> bool:
        """Make this step plain to measure one, where that loses little: the best
        option is a costly drafter (whose price depends on the plain step) or gains
        less than MEASURE_BELOW."""
        if self.costs is None or best.slot is None or not self.costs.needs_plain(context_len):
            return False
        return best.slot.costly or rate < MEASURE_BELOW

    def _price_costly(self, slot: Slot, policy: LengthPolicy, context: list[int], k: int,
                      costs: CostModel) -> tuple[int, float]:
        """(length, rate) of asking this costly drafter now; (0, 0) while paused. A
        probe is taken where the best length would pay, but asks for one token."""
        if not slot.tick():
            return 0, 0.0
        pending = getattr(slot.drafter, "pending", None)
        unseen = max(0, (pending(context) if pending else 1) - 1) if slot.prices_catchup else 0
        catchup = unseen * costs.catchup_per_token
        length, rate = best_length(costs, policy.acceptance(k), k, overhead=catchup)
        return (min(length, 1) if slot.probing else length), rate

    def observe(self, plan: Plan, accepted: int, draft_seconds: float, verify_seconds: float,
                context_len: int) -> None:
        """The step planned as `plan` accepted `accepted` draft tokens; its drafting
        and verification took these seconds, after context_len accepted tokens."""
        if self.costs is not None:
            self.costs.observe_pass(len(plan.draft) + 1, verify_seconds, context_len)
        slot = plan.slot
        if slot is not None and len(plan.draft):
            self._judge(plan, accepted, draft_seconds + verify_seconds, context_len)
        if slot is None or not slot.costly or not len(plan.draft):
            return
        plan.policy.observe(len(plan.draft), accepted)
        self._observe_draft_costs(slot)
        if slot.probing:
            slot.probing = False
            if accepted == 0:
                slot.pause()
            return
        slot.recent.append((accepted + 1, self._step_cost(plan, draft_seconds + verify_seconds,
                                                          context_len)))
        if len(slot.recent) >= 3:
            tokens, cost = map(sum, zip(*slot.recent))
            if tokens < cost:  # fewer tokens than plain steps would have given
                slot.pause()
            else:
                slot.failures = 0

    def _judge(self, plan: Plan, accepted: int, seconds: float, context_len: int) -> None:
        """The collapse guard's evidence from a verified draft: it paid when it emitted at
        least its cost in plain steps (a free draft: its verification alone)."""
        if accepted + 1 >= self._step_cost(plan, seconds, context_len):
            self.guard.paid()
        else:
            self.guard.below()

    def _step_cost(self, plan: Plan, seconds: float, context_len: int) -> float:
        """A step's cost in plain steps: observed, or predicted when not learning."""
        if self.costs is not None:
            return seconds / self.costs.plain_seconds(context_len)
        costs, n = plan.costs or self.prior, len(plan.draft)
        return costs.c(n + 1) + n * costs.draft_per_token

    def _observe_draft_costs(self, slot: Slot) -> None:
        timing = getattr(slot.drafter, "timing", None)
        if self.costs is None or timing is None:
            return
        fed, first, rest_tokens, rest = timing
        self.costs.observe_draft(rest_tokens, rest)
        if fed > 1 and rest_tokens:
            self.costs.observe_catchup(fed - 1, max(0.0, first - rest / rest_tokens))

    def describe(self, k: int, context_len: int = 0) -> str:
        """One line: the options now (at their priors; free ones priced as
        `_price_free` prices them) and their predicted rates."""
        costs = self.cost_model(context_len)
        parts = []
        for slot in self.slots:
            policy = slot.policy
            rates = policy.acceptance(k) if slot.costly else policy.priced(k)
            length, rate = best_length(costs, rates, k)
            parts.append(f"{slot.name}: draft length {length} of {k} "
                         f"(predicted {rate:.2f}x plain steps)")
        return "; ".join(parts)
