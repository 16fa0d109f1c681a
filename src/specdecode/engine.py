"""The speculative decoding loop: draft, verify in one target pass, emit, repeat.

Plain decoding is the same loop with no drafter (or k = 0): every step then
verifies an empty draft and emits the target's own next token, so plain and
speculative runs share the sampling and stop code and are comparable.

Cache convention: the last token of the accepted sequence ("pending") is not
yet in the target's cache. A step feeds [pending, d_1..d_k] and gets k+1 rows
of logits; row i scores the token after d_1..d_i. After n accepted drafts the
cache is rolled back to the accepted prefix and the recovered/bonus token
becomes the new pending token. The prompt's last token is pending at start,
so even the first new token comes from a (possibly speculative) step.

Stops are checked on every emitted token, in order, even inside an accepted
draft: stop token ids (EOS unless ignored) -> stop hook (stop strings) ->
max_tokens -> context limit. The stop token itself is part of the output.

A drafter that raises (in begin, propose, observe or finish) is switched off
for the rest of that request: the error is logged once, the step goes on with
an empty draft (plain) or the other drafters, so the output is what plain
decoding gives; the next request asks it again.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.controller import Control, Controller, Plan
from specdecode.drafters.base import Draft, DraftContext, Drafter, TargetOutput
from specdecode.models.base import CausalLM
from specdecode.prefix_store import PrefixStore
from specdecode.sampling import SamplingParams, request_key
from specdecode.speclen import LengthPolicy
from specdecode.stats import SpecStats
from specdecode.verify import Verifier, VerifierFactory, VerifyResult, make_verifier

log = logging.getLogger(__name__)

StopHook = Callable[[list[int]], bool]
"""Called with all output token ids after each emitted token; True stops there
(finish_reason "stop"). Stop strings plug in here through a tokenizer."""


class _Holder:
    """A request's mark on the target whose cache holds its tokens."""


_CACHE_HOLDER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> _Holder


@dataclass
class Request:
    """Everything one request owns while it decodes (the decoder holds none of it).

    From `SpeculativeDecoder.start`; `step` advances it. context: prompt +
    output so far (its last token is pending: not yet in the target's cache).
    control: the request's controller state (None: no controller). verifier:
    chosen once from params. last / target_out: the previous step's
    verification and the target's outputs at its accepted positions (for the
    drafters' context). finish_reason: set when it has ended."""

    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    key: int  # with the position, seeds each target draw (sampling.position_uniform)
    stops: set[int]
    stop_hook: StopHook | None
    verifier: Verifier
    controller: Controller | None
    control: Control | None
    context: list[int]
    output: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    started: float = 0.0
    last: VerifyResult | None = None
    target_out: TargetOutput | None = None
    finish_reason: str | None = None
    finished: bool = False  # the drafters' and controller's finish hooks have run
    token: _Holder = field(default_factory=lambda: _Holder())  # marks the target's cache
    failed: set[int] = field(default_factory=set)  # id() of drafters that raised

    def usable(self, drafter: Drafter | None) -> bool:
        """Whether `drafter` may still be asked in this request."""
        return drafter is not None and id(drafter) not in self.failed

    def draft_context(self, k: int) -> DraftContext:
        return DraftContext(self.context, k, self.params, self.generator, len(self.prompt),
                            self.last, self.target_out)


@dataclass
class StepEvent:
    """Tokens emitted by one step; finish_reason is set on the last event. stats: the
    request's running totals (the same object at every step of one request)."""

    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    stats: SpecStats


class SpeculativeDecoder:
    """Lossless speculative decoding of `target` with proposals from `drafter`.

    Greedy (temperature 0) output is token-for-token the target's own greedy
    output wherever the target's (k + 1)-token pass gives the logits its
    one-token pass gives (float32 torch; bf16 and llama.cpp batches can round
    differently and part at near-ties: README "Exactness"); sampled output has
    the target's distribution (exact rejection sampling). k is the number of
    draft tokens per step; k = 0 or no drafter is plain decoding. With a
    `controller` (controller.py) each step's drafter and draft length come from
    observed costs and acceptance (it may choose a plain step); `length_policy`
    is the shorthand for a controller of `drafter` alone that decides with the
    policy's fixed costs. Without either, always k draft tokens (fewer only when
    the drafter has fewer). Each request's verifier comes from the `verifier`
    factory (verify.make_verifier: greedy, or sampling: with a seed, a sample is
    the same with speculation on or off when the drafter gives no q; drafts with
    q go through exact rejection sampling).

    Per-request state lives in `Request` (from `start`), so requests can be
    interleaved step by step; each request's tokens must then be in the
    target's cache when it steps: the decoder re-prefills a request whose
    cache another request has overwritten (a second sequence handle avoids it).
    """

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        k: int = 4,
        *,
        eos_token_ids: Sequence[int] | None = None,
        verifier: VerifierFactory = make_verifier,
        length_policy: LengthPolicy | None = None,
        controller: Controller | None = None,
        clock: Callable[[], float] = time.perf_counter,
        prefix_cache: bool | None = None,
        prefix_store: PrefixStore | None = None,
    ) -> None:
        """clock: the time source of the step timings the controller learns from.
        prefix_cache: reuse what the target's cache holds of a new request's prompt
        (False: prefill every request from its first token; None: unless
        $SPECDECODE_PREFIX_CACHE is 0). prefix_store: earlier caches kept in memory
        and swapped back in when a request continues one of them (prefix_store.py;
        with the prefix cache only)."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"k (num_speculative_tokens) must be an integer >= 0, got {k!r}")
        if controller is not None and (drafter is not None or length_policy is not None):
            raise ValueError("give a controller or a drafter (and length policy), not both")
        self.target, self.drafter, self.k = target, drafter, k
        self.eos_token_ids = tuple(
            target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.verifier = verifier
        self.length_policy = length_policy
        self._controller, self.clock = controller, clock
        self.prefix_cache = (os.environ.get("SPECDECODE_PREFIX_CACHE", "1") != "0"
                             if prefix_cache is None else prefix_cache)
        self.prefix_store = prefix_store

    @property
    def controller(self) -> Controller | None:
        return self._controller

    @property
    def drafters(self) -> list[Drafter]:
        """Every drafter a step may use."""
        if self._controller is not None:
            return self._controller.drafters
        return [] if self.drafter is None else [self.drafter]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers some drafter reads (BaseDrafter.hidden_layers)."""
        layers = {i for d in self.drafters for i in getattr(d, "hidden_layers", ())}
        return tuple(sorted(layers))

    @property
    def context_rows(self) -> int:
        """How many past positions' hidden states some drafter reads
        (BaseDrafter.context_rows; 0: the last pass's accepted positions only)."""
        return max((getattr(d, "context_rows", 0) for d in self.drafters), default=0)

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        seed: int | None = None,
        stop_hook: StopHook | None = None,
    ) -> Request:
        """Begin a request: prefill all but the prompt's last token, start the drafters.

        prompt_ids: at least one token, shorter than the context limit.
        seed: seeds the one torch.Generator behind all sampling (None: random)."""
        started = time.perf_counter()
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_ids)
        generator = torch.Generator(device=self.target.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        key = request_key(generator)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.eos_token_ids)
        controller = self._request_controller()
        control = controller.begin() if controller is not None else None
        request = Request(prompt, params, generator, key, stops, stop_hook,
                          self.verifier(params, key, generator), controller, control,
                          list(prompt), started=started)
        request.stats.cached_tokens = self._prefill(request)
        for drafter in self.drafters:
            self._call(request, drafter, "begin", prompt, params, generator)
        request.stats.prefill_time = time.perf_counter() - started
        return request

    def _request_controller(self) -> Controller | None:
        """The controller of a new request (a length policy: one over `drafter` alone,
        new for each request, as its pauses are the request's)."""
        if self._controller is None and self.length_policy is not None and self.drafter:
            return Controller.single(self.drafter, self.length_policy)
        return self._controller

    def _prefill(self, request: Request) -> int:
        """Put the request's accepted tokens but the pending one in the target's cache,
        reusing the longest prefix the cache already holds (CausalLM.cached_ids: the
        previous request's prompt and output, an agent's earlier turns); returns the
        number of tokens reused. The keys/values reused were computed in other
        passes than a fresh prefill's (one-token steps, verification batches, other
        chunks), which round differently in the last bits: on float32 torch about
        1e-5 of the logits' scale (greedy outputs measured identical in
        tests/test_prefix_cache.py); on bf16 and llama.cpp more, so outputs can part
        at a near-tie (README "Exactness"). SPECDECODE_PREFIX_CACHE=0 (or
        prefix_cache=False) prefills every request from its first token."""
        want, layers = request.context[:-1], self.hidden_layers
        first_state = bool(layers) and request.target_out is None  # the first step reads it
        if self.prefix_store is not None and self.prefix_cache:
            self.prefix_store.swap_in(self.target, want)
        start = self._reusable(want, first_state)
        self.target.rollback(start)
        if start < len(want):
            ids = torch.tensor(want[start:], dtype=torch.long)  # [T] int64
            kwargs = {"hidden_layers": layers} if layers else {}  # (models without them too)
            rows = self.context_rows
            if rows:
                kwargs["hidden_all"] = True
            out = (self.target.forward(ids, last_n=1, **kwargs) if start
                   else self.target.prefill(ids, **kwargs))
            if first_state:
                request.target_out = TargetOutput(out.logits[-1:], {  # all rows if asked
                    i: h if rows else h[-1:] for i, h in out.hidden_states.items()})
        _CACHE_HOLDER[self.target] = request.token
        return start

    def _reusable(self, want: list[int], need_last: bool) -> int:
        """How many of `want`'s first tokens the target's cache holds and may keep
        (the last one is run again when its output is needed)."""
        cached = getattr(self.target, "cached_ids", None) if self.prefix_cache else None
        if not cached:
            return 0
        common = 0
        for a, b in zip(cached, want):
            if a != b:
                break
            common += 1
        if need_last and common == len(want):
            common -= 1
        for drafter in self.drafters:  # a drafter's own cache must see the states it lacks
            held = getattr(drafter, "states_held", None)
            if held is not None:
                common = min(common, held(want))
        reuse_from = getattr(self.target, "reuse_from", None)
        return max(0, reuse_from(common, len(want)) if reuse_from else common)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        seed: int | None = None,
        stop_hook: StopHook | None = None,
    ) -> GenerationResult:
        """Generate to a stop; see `start` for the arguments."""
        tokens: list[int] = []
        for event in self.stream(prompt_ids, params, seed, stop_hook):
            tokens += event.token_ids
        return GenerationResult(tokens, event.finish_reason or "length", event.stats)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        seed: int | None = None,
        stop_hook: StopHook | None = None,
    ) -> Iterator[StepEvent]:
        """Yield the tokens of each step as soon as they are verified (see `start`)."""
        request = self.start(prompt_ids, params, seed, stop_hook)
        try:
            while True:
                event = self.step(request)
                yield event
                if event.finish_reason:
                    return
        finally:
            self.finish(request)

    def step(self, request: Request) -> StepEvent:
        """One draft-verify step of `request`: the tokens it emitted (finish_reason set
        on its last step, after which it must not be stepped again)."""
        if request.finish_reason is not None:
            raise ValueError("this request has finished")
        if _CACHE_HOLDER.get(self.target) is not request.token:
            self._prefill(request)  # another request used the cache since
        context, output, stats = request.context, request.output, request.stats
        t0 = self.clock()
        budget = min(request.params.max_tokens - len(output),
                     self.target.max_seq_len - len(context))
        plan = self._plan(request, min(self.k, budget - 1))
        t1 = self.clock()
        result = self._verify(request, plan.draft)
        t2 = self.clock()
        self._observe(request, plan, result, t1 - t0, t2 - t1)
        new, finish = self._emit(request, result.tokens)
        self._record(stats, plan, result, new)
        t3 = self.clock()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.other_time += t3 - t2
        stats.wall_time = time.perf_counter() - request.started
        request.finish_reason = finish
        if finish:
            self.finish(request)
        return StepEvent(new, finish, stats)

    def finish(self, request: Request) -> None:
        """End a request (once): the drafters hear its output, the controller keeps
        what carries to the next request. `step` calls it on the last step."""
        if request.finished:
            return
        request.finished = True
        if request.control is not None:
            request.control.finish()
        for drafter in self.drafters:
            if getattr(drafter, "finish", None) is not None:
                self._call(request, drafter, "finish", list(request.output))

    def _call(self, request: Request, drafter: Drafter, method: str, *args):
        """drafter.method(*args), unless the drafter raised before in this request (then
        None). An exception switches it off for the rest of the request (the
        controller leaves its slot out), is logged once and counted in the stats."""
        if not request.usable(drafter):
            return None
        try:
            return getattr(drafter, method)(*args)
        except Exception:
            request.failed.add(id(drafter))
            request.stats.drafter_errors += 1
            if request.control is not None:
                request.control.failed |= {i for i, slot in enumerate(request.control.slots)
                                           if slot.drafter is drafter}
            log.warning("drafter %s raised in %s; it is off for the rest of this request "
                        "(decoding goes on without it, the output is unchanged)",
                        getattr(drafter, "name", type(drafter).__name__), method,
                        exc_info=True)
            return None

    def _observe(self, request: Request, plan: Plan, result: VerifyResult,
                 draft_seconds: float, verify_seconds: float) -> None:
        """Tell the drafter and the controller how the step went."""
        drafter = plan.slot.drafter if plan.slot else (
            None if request.control is not None else self.drafter)
        if drafter is not None:
            self._call(request, drafter, "observe", result.num_accepted)
        controller = request.controller
        if controller is not None:
            engaged = controller.guard.engagements
            controller.observe(plan, result.num_accepted, draft_seconds, verify_seconds,
                               len(request.context))
            request.stats.guard_engagements += controller.guard.engagements - engaged
            request.stats.speculation_paused = controller.guard.engaged

    @staticmethod
    def _record(stats: SpecStats, plan: Plan, result: VerifyResult, new: list[int]) -> None:
        """One step in the request's stats (a stop can cut the emitted tokens)."""
        draft = plan.draft
        accepted = min(result.num_accepted, len(new))
        cut = len(new) < len(result.tokens)
        tried = accepted if cut else min(len(draft), result.num_accepted + 1)
        name = getattr(plan.slot.drafter if plan.slot else None, "name", None)
        stats.guard_plain_steps += plan.guarded
        stats.record_step(len(draft), accepted, len(new), tried, name if len(draft) else None)

    def _emit(self, request: Request, tokens: tuple[int, ...]) -> tuple[list[int], str | None]:
        """Append the step's tokens to output and context up to the first stop; returns
        (the tokens emitted, finish_reason or None)."""
        output, context, params = request.output, request.context, request.params
        new: list[int] = []
        for token in tokens:
            new.append(token)
            output.append(token)
            context.append(token)
            if token in request.stops or (
                    request.stop_hook is not None and request.stop_hook(output)):
                return new, "stop"
            if len(output) >= params.max_tokens or len(context) >= self.target.max_seq_len:
                return new, "length"
        return new, None

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        if len(prompt) >= self.target.max_seq_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the context limit of "
                f"{self.target.max_seq_len} leaves no room for a new token")
        return prompt

    def _plan(self, request: Request, k: int) -> Plan:
        """This step's draft: the controller's choice, or the drafter's k tokens."""
        ctx = request.draft_context(k)
        stops = request.stops
        if request.controller is None:
            return Plan(self._propose(request, self.drafter, ctx, stops))
        guard, engaged = request.controller.guard, request.controller.guard.engagements
        plan = request.controller.plan(request.control, ctx,
                                       lambda d, c: self._propose(request, d, c, stops))
        request.stats.guard_engagements += guard.engagements - engaged
        return plan

    def _propose(self, request: Request, drafter: Drafter | None, ctx: DraftContext,
                 stops: set[int]) -> Draft:
        """Ask the drafter for up to ctx.k tokens; cut the draft after its first stop.
        A drafter that raises (or raised before in this request) drafts nothing."""
        if not request.usable(drafter) or ctx.k <= 0:
            return Draft.empty()
        draft = self._call(request, drafter, "propose", ctx)
        if draft is None:
            return Draft.empty()
        draft = draft.truncate(ctx.k)
        if not draft.is_chain:
            raise NotImplementedError("tree drafts are not verified yet: propose a chain")
        for i, token in enumerate(draft.tokens.tolist()):
            if token in stops:  # nothing after a stop token can be emitted
                return draft.truncate(i + 1)
        return draft

    def _verify(self, request: Request, draft: Draft) -> VerifyResult:
        """One target pass over [pending, draft...], the request's verifier's decision,
        and the cache cut back to the accepted prefix; keeps the target's outputs at
        the accepted positions for the next step's drafters."""
        context = request.context
        ids = torch.cat((torch.tensor([context[-1]], dtype=torch.long), draft.tokens.cpu()))
        layers = self.hidden_layers
        out = (self.target.forward(ids, hidden_layers=layers) if layers
               else self.target.forward(ids))
        logits = out.logits  # [k + 1, vocab_size]
        result = request.verifier.verify(draft.tokens, draft.q, logits, len(context))
        self.target.rollback(len(context) + result.num_accepted)
        rows = result.num_accepted + 1
        hidden = out.hidden_states if layers else {}
        request.last = result
        hidden = {i: h[:rows] for i, h in hidden.items()}
        keep, before = self.context_rows, request.target_out
        if keep and before is not None:  # the positions before, as far back as asked
            hidden = {i: torch.cat((before.hidden[i], h))[-keep:] for i, h in hidden.items()}
        request.target_out = TargetOutput(logits[:rows], hidden)
        return result
