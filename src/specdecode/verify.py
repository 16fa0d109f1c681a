"""Chain verification: which draft tokens the target keeps, and the token after.

Pure functions over tensors; no models. Vocabulary of one step:

- draft tokens d_1..d_k: what the drafter proposed.
- p: the target's probabilities at the k+1 positions of one verification pass
  (row i is the target's distribution for the token after d_1..d_i).
- q: the drafter's probabilities for d_1..d_k (row i is what d_{i+1} was
  sampled from), or None: a drafter without probabilities is a point mass on
  its own tokens, which is still exact.
- accepted tokens: the longest prefix of the draft that the verifier keeps.
- recovered token: after the first rejection at position i, a token sampled
  from normalize(max(0, p_i - q_i)); it replaces the rejected draft token.
- bonus token: after a full accept, a token sampled from p_k.

Either way a step emits `num_accepted + 1` tokens, so it never does worse than
plain decoding in tokens per target pass. Greedy verification keeps d_i while
it equals the target's argmax and then emits the argmax; rejection sampling
(Leviathan et al. 2023; Chen et al. 2023) accepts d_i with probability
min(1, p_i(d_i) / q_i(d_i)), which makes the emitted tokens distributed exactly
as the target's own samples. All randomness comes from an explicit generator.

For a draft without q (a point mass), `match_sample` is the same law by other
means: draw the target's own token at each position and keep d_i while the
draw equals it. With one uniform number per position (sampling.position_uniform)
each emitted token is exactly the one plain decoding draws there, so a seeded
sample does not depend on the drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.sampling import (
    SamplingParams,
    logits_to_probs,
    position_uniform,
    sample,
    sample_at,
)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification pass.

    num_accepted: how many draft tokens were kept (0..k).
    next_token: the recovered token (num_accepted < k) or bonus token (== k).
    tokens: the emitted tokens, accepted drafts followed by next_token.
    path: the draft indices of the accepted tokens, root first (a chain: 0..n-1;
        a tree: the accepted branch, which `CausalLM.keep` compacts the cache to).
    """

    num_accepted: int
    next_token: int
    tokens: tuple[int, ...]
    path: tuple[int, ...] | None = None

    @property
    def accepted_path(self) -> tuple[int, ...]:
        return tuple(range(self.num_accepted)) if self.path is None else self.path


def _result(draft_tokens: torch.Tensor, num_accepted: int, next_token: int) -> VerifyResult:
    kept = tuple(int(t) for t in draft_tokens[:num_accepted].tolist())
    return VerifyResult(num_accepted, next_token, kept + (next_token,))


def greedy_verify(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k + 1, vocab_size]
) -> VerifyResult:
    """Keep draft tokens while they equal the target's argmax; then emit the argmax."""
    k = draft_tokens.shape[0]
    assert target_logits.shape[0] == k + 1, "need one more target row than draft tokens"
    target_argmax = target_logits.argmax(dim=-1)  # [k + 1]
    mismatch = (draft_tokens.to(target_argmax.device) != target_argmax[:k]).nonzero()
    num_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return _result(draft_tokens, num_accepted, int(target_argmax[num_accepted]))


def rejection_sample(
    draft_tokens: torch.Tensor,  # [k] int64
    p: torch.Tensor,  # [k + 1, vocab_size] float32 target probs
    q: torch.Tensor | None,  # [k, vocab_size] float32 draft probs, None = point mass
    generator: torch.Generator | None,
) -> VerifyResult:
    """Exact speculative sampling: the emitted tokens are distributed as samples of p.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection emit a recovered token from normalize(max(0, p_i - q_i)); after a
    full accept emit a bonus token from p_k.
    """
    k = draft_tokens.shape[0]
    assert p.shape[0] == k + 1, "need one more target row than draft tokens"
    draft_tokens = draft_tokens.to(p.device)
    if k:
        rows = torch.arange(k, device=p.device)
        p_draft = p[rows, draft_tokens]  # [k]
        q_draft = q[rows, draft_tokens] if q is not None else torch.ones_like(p_draft)
        u = torch.rand(k, generator=generator, device=p.device)  # [k]
        # u < p/q, written without a division so q == 0 < p accepts and 0/0 rejects.
        rejected = (u * q_draft >= p_draft).nonzero()
        num_accepted = int(rejected[0, 0]) if rejected.numel() else k
    else:
        num_accepted = 0
    if num_accepted == k:
        return _result(draft_tokens, k, sample(p[k], generator))
    i = num_accepted
    if q is not None:
        q_i = q[i]
    else:
        q_i = torch.zeros_like(p[i]).index_fill_(0, draft_tokens[i : i + 1], 1.0)
    residual = (p[i] - q_i).clamp_min(0.0)  # [vocab_size]
    total = residual.sum()
    # p == q everywhere leaves no residual mass; a rejection then has probability
    # zero, so only rounding gets here, and p is the distribution to fall back on.
    recovered_from = residual / total if total > 0 else p[i]
    return _result(draft_tokens, i, sample(recovered_from, generator))


def match_sample(
    draft_tokens: torch.Tensor,  # [k] int64
    p: torch.Tensor,  # [k + 1, vocab_size] float32 target probs
    uniforms: Callable[[int], float],  # row i -> the uniform number of its position
) -> VerifyResult:
    """Exact speculative sampling for a point-mass draft, by drawing and matching.

    Row by row, draw y_i = sample_at(p_i, uniforms(i)); keep d_i while y_i == d_i;
    emit the first y_i that differs (recovered) or y_k (bonus). The law is
    rejection_sample's with q = a point mass on d_i: P(keep d_i) = p_i(d_i) =
    min(1, p_i(d_i) / 1), and a draw that differs from d_i is distributed as
    p_i without d_i, renormalised = normalize(max(0, p_i - q_i)). Rows after
    the first mismatch are not drawn."""
    k = draft_tokens.shape[0]
    assert p.shape[0] == k + 1, "need one more target row than draft tokens"
    drafts = draft_tokens.tolist()
    for i in range(k + 1):
        token = sample_at(p[i], uniforms(i))
        if i == k or token != drafts[i]:
            return _result(draft_tokens, i, token)
    raise AssertionError("unreachable: row k always returns")


RejectionSampler = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Generator | None"], VerifyResult]
"""(draft tokens [k], p [k + 1, V], q [k, V] or None, generator) -> VerifyResult."""


class Verifier(Protocol):
    """One request's verification rule, chosen once when the request starts."""

    def verify(
        self,
        draft_tokens: torch.Tensor,  # [k] int64
        q: torch.Tensor | None,  # [k, vocab_size] float32 draft probs; None: point mass
        logits: torch.Tensor,  # [k + 1, vocab_size] target logits of the pass
        start: int,  # sequence position of the first token the pass scores
    ) -> VerifyResult:
        """Which draft tokens to keep, and the token after them. Lossless for any draft."""
        ...


class GreedyVerifier:
    """Temperature 0: keep draft tokens while they equal the target's argmax."""

    def verify(self, draft_tokens: torch.Tensor, q: torch.Tensor | None,  # [k], [k, V]
               logits: torch.Tensor, start: int) -> VerifyResult:  # logits: [k + 1, V]
        return greedy_verify(draft_tokens, logits)


class SamplingVerifier:
    """Temperature > 0 with the request's params. A draft without q (n-gram lookup,
    or none: plain decoding) is verified by `match_sample` with each position's
    uniform number (sampling.position_uniform of the request key), so a seeded
    sample is the same with or without such drafts; a draft with q goes through
    `rejection` (exact rejection sampling) and the request's generator."""

    def __init__(self, params: SamplingParams, key: int, generator: torch.Generator | None,
                 rejection: RejectionSampler = rejection_sample) -> None:
        self.params, self.key, self.generator, self.rejection = params, key, generator, rejection

    def verify(self, draft_tokens: torch.Tensor, q: torch.Tensor | None,  # [k], [k, V]
               logits: torch.Tensor, start: int) -> VerifyResult:  # logits: [k + 1, V]
        return self.verify_probs(draft_tokens, q, logits_to_probs(logits, self.params), start)

    def verify_probs(self, draft_tokens: torch.Tensor,  # [k] int64
                     q: torch.Tensor | None,  # [k, vocab_size] draft probs; None: point mass
                     p: torch.Tensor,  # [k + 1, vocab_size] target probs, already warped
                     start: int) -> VerifyResult:
        """`verify` after the warping: the rule itself (check/distribution.py runs it
        on captured p without recomputing them)."""
        if q is None:
            return match_sample(draft_tokens, p, lambda i: position_uniform(self.key, start + i))
        return self.rejection(draft_tokens, p, q.to(p.device), self.generator)


VerifierFactory = Callable[[SamplingParams, int, "torch.Generator | None"], Verifier]
"""(params, request key, generator) -> the request's verifier."""


def make_verifier(params: SamplingParams, key: int, generator: torch.Generator | None,
                  rejection: RejectionSampler = rejection_sample) -> Verifier:
    """The verifier for a request: greedy at temperature 0, else sampling."""
    if params.greedy:
        return GreedyVerifier()
    return SamplingVerifier(params, key, generator, rejection)
