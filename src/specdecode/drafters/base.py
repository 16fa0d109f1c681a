"""The `Drafter` protocol: propose a draft from a `DraftContext`, hear how it went.

A drafter carries its own state (a KV cache, an n-gram index) and keeps it in
step with the accepted prefix. `DraftContext.tokens` is always the full
accepted sequence of the request, prompt included, ending with the last
emitted token; it never contains rejected drafts, so a drafter can
resynchronise by comparing it with what it has seen (which also makes a
drafter shared by interleaved requests correct: it resynchronises, slower).
Everything request-specific a drafter needs (sampling parameters, the
generator, the target's outputs of the last pass) comes in the context, not
from `begin`.

`BaseDrafter` gives no-op defaults for every hook; a drafter overrides
`propose` and what it needs. The engine calls, per request: `begin` once,
then per step `propose` and `observe`, and `finish` once with the output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specdecode.sampling import SamplingParams

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM


MATCH_PRIORS: dict[int, tuple[float, float]] = {1: (0.6, 2.0), 2: (1.0, 2.0), 3: (1.4, 2.0)}
"""A lookup's (accepted, tried) acceptance prior by Draft.kind = the length of its
match (n-gram and suffix lookup declare it as `kind_priors`; a match of 4+ tokens
and the pooled estimate keep the length policy's prior, 90 %): a short match
predicts less, and hindsight raises a kind that proves right. Replayed on 38
recorded answers, each on a fresh controller, with four cost curves
(bench/llama_cpp/prior_replay.py, bench/results/prior-replay.md): where c(2) is
1.6-1.7, 90 % for every kind left 3-8 answers below 0.98x plain (chat 0.97-0.99x),
these priors none or one (chat 1.00x) with HumanEval as fast or faster; where
c(2) is 2.25 no change."""


@dataclass
class Draft:
    """Proposed tokens and, if the drafter has them, the probabilities they came from.

    tokens: [k] int64.
    q: [k, vocab_size] float32, row i the distribution tokens[i] was sampled
       from; None means a point mass on each token (exact all the same).
    kind: which kind of proposal this is, for acceptance estimated per kind
       (n-gram lookup: the length of the matched n-gram; 0: one kind only); a
       drafter may declare each kind's starting estimate as `kind_priors`
       ({kind: (accepted, tried)}, controller.Slot).
    parents: [k] int64, the index of each token's parent in the draft (-1: the
       pending token, the root), for a token tree; None is a chain (token i's
       parent is i - 1). Only chains are verified for now.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    kind: int = 0
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return self.parents is None or bool(
            (self.parents == torch.arange(-1, len(self) - 1)).all())

    def truncate(self, n: int) -> Draft:
        """The first n tokens (a chain's prefix; for a tree, the nodes 0..n-1, whose
        parents all come before them)."""
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], self.kind,
                     None if self.parents is None else self.parents[:n])

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long))


@dataclass
class TargetOutput:
    """The target's outputs at the positions the last pass accepted.

    logits: [n, vocab_size] float32, row i scoring the token after accepted
        position i of the pass (n = accepted draft tokens + 1; the last row
        scored the token that was emitted as recovered/bonus).
    hidden: layer -> [n, hidden_size] for the layers the drafters asked for
        (`BaseDrafter.hidden_layers`), the same rows; where a drafter asks for
        `context_rows` > 0, the rows reach further back instead, in order, up to the
        position before the pending token (the logits' last row): after a prefill,
        every position it ran; after a pass, the last context_rows positions
        across passes (steps no drafter was asked in included).
    """

    logits: torch.Tensor
    hidden: Mapping[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class DraftContext:
    """What a drafter is told when asked for a draft.

    tokens: the accepted sequence (prompt + output so far), ending with the last
        emitted token, which is not yet in the target's cache. It is the request's
        live list (no copy per step): read it during the call, copy what you keep.
    k: the most draft tokens this step can use (the budget; >= 1).
    params / generator: the request's sampling parameters and random source
        (a drafter that samples uses these, so interleaved requests keep theirs).
    prompt_len: how many of `tokens` are the prompt.
    last: the previous step's verification (None at the first step).
    target: the target's outputs of the previous pass at its accepted positions
        (at the first step: the prefill's last position, which precedes the pending
        token; None where no drafter asked for hidden states, or the prompt is one
        token).
    """

    tokens: list[int]
    k: int
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    prompt_len: int = 0
    last: object | None = None  # verify.VerifyResult
    target: TargetOutput | None = None

    def with_k(self, k: int) -> DraftContext:
        """The same context with another budget."""
        return DraftContext(self.tokens, k, self.params, self.generator, self.prompt_len,
                            self.last, self.target)


@runtime_checkable
class Drafter(Protocol):
    name: str

    def begin(
        self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator
    ) -> None:
        """Start a new request (a drafter that keeps per-request state resets it)."""
        ...

    def propose(self, ctx: DraftContext) -> Draft:
        """Up to ctx.k tokens likely to follow ctx.tokens (fewer, or none, is fine)."""
        ...

    def observe(self, num_accepted: int) -> None:
        """The verifier kept `num_accepted` tokens of the last draft."""
        ...


class BaseDrafter:
    """No-op defaults for the drafter hooks; subclasses override `propose`.

    name: shown in stats (`drafter_steps`) and `info.drafter`.
    draft_model: the CausalLM this drafter runs (None: it runs no model): how
        costs are measured and memory is counted, instead of probing attributes.
    hidden_layers: target layers whose hidden states this drafter reads from
        `DraftContext.target.hidden` (models.base: layer numbering).
    context_rows: how many past positions' states it reads after a pass
        (TargetOutput.hidden: kept across passes it was not asked in; 0: the last
        pass's accepted positions only). Each pass copies that many rows.
    priced: its drafts cost compute (a model, a trained head): the controller
        prices a draft before asking for it and learns the price from the
        drafter's `timing` (drafters/draft_model.py); False: a lookup, free, judged
        in hindsight. A drafter with a draft_model is priced whatever this says.
    """

    name = "drafter"
    draft_model: CausalLM | None = None
    priced: bool = False
    hidden_layers: tuple[int, ...] = ()
    context_rows: int = 0

    def begin(
        self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator
    ) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        return Draft.empty()

    def observe(self, num_accepted: int) -> None:
        pass

    def pending(self, tokens: list[int]) -> int:
        """Tokens a proposal after `tokens` must feed its model first (catch-up)."""
        return 0

    def finish(self, output_ids: list[int]) -> None:
        """The request ended with these output tokens (e.g. to remember them)."""

    def close(self) -> None:
        """Free what the drafter holds (its model's memory); it is not used again."""
        if self.draft_model is not None and hasattr(self.draft_model, "close"):
            self.draft_model.close()
