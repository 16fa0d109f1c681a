"""Sampling parameters and the one logits -> probabilities function.

The same `logits_to_probs` turns draft logits into q and target logits into p,
so a drafter and the verifier can never disagree about what a temperature or a
top-p means. Temperature 0 is greedy: the probabilities are a one-hot vector
on the argmax (first index on ties, as `torch.argmax`).

Order of the filters (as HF transformers' warpers and vLLM's sampler):
temperature -> top_k -> top_p -> softmax -> min_p -> renormalise.

Seeded sampling is reproducible per position: the target's token at sequence
position t of a request is drawn by `sample_at(p, position_uniform(key, t))`,
key drawn once per request from its seeded generator. Plain decoding and speculation
with drafts that carry no q (n-gram lookup) then draw each token with the same
random numbers and emit the same text for the same seed (see
verify.match_sample), as llama.cpp's own speculation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop, for one request.

    temperature: 0 means greedy; > 0 scales the logits.
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set whose probability reaches top_p (1.0 = off).
    min_p: drop tokens below min_p * max probability (0.0 = off).
    max_tokens: at most this many new tokens.
    stop_token_ids: extra token ids that end generation (like EOS).
    ignore_eos: keep going past the model's EOS tokens.
    stop: stop strings (one string alone is read as a one-string tuple, as the OpenAI
        API reads `stop`); the engine sees them only through a stop hook that a
        tokenizer-aware caller builds (see `engine.StopHook`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # one string is one stop string (not its characters); a list becomes a tuple
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                           else tuple(self.stop))
        _check(_is_number(self.temperature), "temperature must be a number")
        _check(math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature}")
        _check(_is_int(self.top_k) and self.top_k >= 0,
               f"top_k must be an integer >= 0, got {self.top_k}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop strings must be non-empty strings, got {self.stop}")

    @property
    def greedy(self) -> bool:
        """Temperature below 1e-5 is greedy (as vLLM): dividing by it would overflow."""
        return self.temperature < GREEDY_BELOW


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def logits_to_probs(
    logits: torch.Tensor,  # [..., vocab_size]
    params: SamplingParams,
) -> torch.Tensor:  # [..., vocab_size] float32, rows sum to 1
    """Probabilities the request samples from, for draft (q) and target (p) alike."""
    logits = logits.float()
    if params.greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    probs = logits.softmax(dim=-1)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(
    probs: torch.Tensor,  # [vocab_size] float32
    generator: torch.Generator | None,
) -> int:
    """Draw one token id from `probs` using `generator` (the only randomness)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def request_key(generator: torch.Generator) -> int:
    """The request's sampling key: one 63-bit draw from its (seeded) generator."""
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator,
                             device=generator.device).item())


def position_uniform(key: int, position: int) -> float:
    """The uniform number in [0, 1) that draws the target's token at sequence
    `position` of the request with `key`: 53 bits of a splitmix64 hash of
    (key, position), a counter-based generator. Positions get unrelated numbers
    and a token's number does not depend on how many were drawn before it.
    (Not a torch.Generator per position: a CPU generator keeps only 32 bits of
    its seed, so positions of a long request would share streams.)"""
    z = (key + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def sample_at(
    probs: torch.Tensor,  # [vocab_size] float32
    u: float,
) -> int:
    """The token whose interval of the cumulative distribution holds u * total
    (inverse-CDF sampling, in float64): distributed as probs when u is uniform;
    a token of probability 0 is never drawn."""
    cdf = probs.to(torch.float64).cumsum(0)  # [vocab_size]
    x = torch.tensor([u], dtype=torch.float64, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, x, right=True).item()), probs.shape[0] - 1)
