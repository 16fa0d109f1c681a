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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from specdecode.controller import Controller, Plan
from specdecode.drafters.base import Draft, Drafter
from specdecode.models.base import CausalLM
from specdecode.sampling import (
    SamplingParams,
    logits_to_probs,
    position_uniform,
    request_key,
)
from specdecode.speclen import LengthPolicy
from specdecode.stats import SpecStats
from specdecode.verify import VerifyResult, greedy_verify, match_sample, rejection_sample

StopHook = Callable[[list[int]], bool]
"""Called with all output token ids after each emitted token; True stops there
(finish_reason "stop"). Stop strings plug in here through a tokenizer."""

RejectionSampler = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Generator | None"], VerifyResult]


@dataclass
class StepEvent:
    """Tokens emitted by one step; finish_reason is set on the last event."""

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
    the drafter has fewer). With a seed, a sample is the same with speculation
    on or off when the drafter gives no q (n-gram lookup): every target token is
    drawn with its position's uniform number (verify.match_sample);
    `rejection_sampler` verifies drafts that carry q.
    """

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | None = None,
        k: int = 4,
        *,
        eos_token_ids: Sequence[int] | None = None,
        rejection_sampler: RejectionSampler = rejection_sample,
        length_policy: LengthPolicy | None = None,
        controller: Controller | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """clock: the time source of the step timings the controller learns from."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"k (num_speculative_tokens) must be an integer >= 0, got {k!r}")
        if controller is not None and (drafter is not None or length_policy is not None):
            raise ValueError("give a controller or a drafter (and length policy), not both")
        self.target, self.drafter, self.k = target, drafter, k
        self.eos_token_ids = tuple(
            target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.rejection_sampler = rejection_sampler
        self.length_policy = length_policy
        self._controller, self.clock = controller, clock

    @property
    def controller(self) -> Controller | None:
        return self._controller

    def _begin(self, prompt: list[int], params: SamplingParams,
               generator: torch.Generator) -> Controller | None:
        """Prefill all but the prompt's last token; start the drafters and the
        controller on the request; returns the request's controller."""
        self.target.rollback(0)
        if len(prompt) > 1:
            self.target.prefill(torch.tensor(prompt[:-1], dtype=torch.long))
        for drafter in self.drafters:
            drafter.begin(prompt, params, generator)
        controller = self._request_controller()
        if controller is not None:
            controller.begin()
        return controller

    def _request_controller(self) -> Controller | None:
        """The controller of this request (a length policy: one over `drafter` alone)."""
        if self._controller is None and self.length_policy is not None and self.drafter:
            return Controller.single(self.drafter, self.length_policy)
        return self._controller

    @property
    def drafters(self) -> list[Drafter]:
        """Every drafter a step may use."""
        if self._controller is not None:
            return self._controller.drafters
        return [] if self.drafter is None else [self.drafter]

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        seed: int | None = None,
        stop_hook: StopHook | None = None,
    ) -> GenerationResult:
        """Generate to a stop; see `stream` for the arguments."""
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
        """Yield the tokens of each step as soon as they are verified.

        prompt_ids: at least one token, shorter than the context limit.
        seed: seeds the one torch.Generator behind all sampling (None: random).
        """
        start = time.perf_counter()
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_ids)
        target, stats = self.target, SpecStats()
        generator = torch.Generator(device=target.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        key = request_key(generator)  # with the position, seeds each target draw
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.eos_token_ids)
        controller = self._begin(prompt, params, generator)
        stats.prefill_time = time.perf_counter() - start

        context, output = list(prompt), []
        while True:
            t0 = self.clock()
            budget = min(params.max_tokens - len(output), target.max_seq_len - len(context))
            plan = self._plan(controller, context, min(self.k, budget - 1), stops)
            t1 = self.clock()
            draft = plan.draft
            result = self._verify(context, draft, params, generator, key)
            target.rollback(len(context) + result.num_accepted)
            t2 = self.clock()
            drafter = plan.slot.drafter if plan.slot else None if controller else self.drafter
            if drafter is not None:
                drafter.observe(result.num_accepted)
            if controller is not None:
                controller.observe(plan, result.num_accepted, t1 - t0, t2 - t1, len(context))
            new, finish = self._emit(result.tokens, output, context, stops, params, stop_hook)
            accepted = min(result.num_accepted, len(new))
            cut = len(new) < len(result.tokens)
            tried = accepted if cut else min(len(draft), result.num_accepted + 1)
            stats.record_step(len(draft), accepted, len(new), tried,
                              getattr(drafter, "name", None) if len(draft) else None)
            t3 = self.clock()
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1
            stats.other_time += t3 - t2
            stats.wall_time = time.perf_counter() - start
            yield StepEvent(new, finish, stats)
            if finish:
                return

    def _emit(self, tokens: list[int], output: list[int], context: list[int], stops: set[int],
              params: SamplingParams, stop_hook: StopHook | None) -> tuple[list[int], str | None]:
        """Append the step's tokens to output and context up to the first stop; returns
        (the tokens emitted, finish_reason or None)."""
        new: list[int] = []
        for token in tokens:
            new.append(token)
            output.append(token)
            context.append(token)
            if token in stops or (stop_hook is not None and stop_hook(output)):
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

    def _plan(self, controller: Controller | None, context: list[int], k: int,
              stops: set[int]) -> Plan:
        """This step's draft: the controller's choice, or the drafter's k tokens."""
        if controller is None:
            return Plan(self._propose(self.drafter, context, k, stops))
        return controller.plan(context, k, lambda d, c, n: self._propose(d, c, n, stops))

    @staticmethod
    def _propose(drafter: Drafter | None, context: list[int], k: int, stops: set[int]) -> Draft:
        """Ask the drafter for up to k tokens; cut the draft after its first stop token."""
        if drafter is None or k <= 0:
            return Draft.empty()
        draft = drafter.propose(context, k).truncate(k)
        for i, token in enumerate(draft.tokens.tolist()):
            if token in stops:  # nothing after a stop token can be emitted
                return draft.truncate(i + 1)
        return draft

    def _verify(
        self, context: list[int], draft: Draft, params: SamplingParams,
        generator: torch.Generator, key: int,
    ) -> VerifyResult:
        """One target pass over [pending, draft...] and the verifier's decision.

        Sampling with a draft without q (or none: plain decoding) draws the token
        at each sequence position with that position's uniform number (match_sample),
        so a seeded sample is the same with or without such drafts; drafts with
        q go through the rejection sampler and the request's generator."""
        ids = torch.cat((torch.tensor([context[-1]], dtype=torch.long), draft.tokens.cpu()))
        logits = self.target.forward(ids).logits  # [k + 1, vocab_size]
        if params.greedy:
            return greedy_verify(draft.tokens, logits)
        p = logits_to_probs(logits, params)  # [k + 1, vocab_size]
        if draft.q is None:
            start = len(context)
            return match_sample(draft.tokens, p, lambda i: position_uniform(key, start + i))
        return self.rejection_sampler(draft.tokens, p, draft.q.to(p.device), generator)
