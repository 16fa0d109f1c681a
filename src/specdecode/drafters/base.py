"""The `Drafter` protocol: propose k tokens, hear how many were accepted.

A drafter carries its own state (a KV cache, an n-gram index) and keeps it in
step with the accepted prefix. The context handed to `propose` is always the
full accepted sequence, prompt included, ending with the last emitted token;
it never contains rejected drafts, so a drafter can resynchronise by
comparing it with what it has seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdecode.sampling import SamplingParams


@dataclass
class Draft:
    """Proposed tokens and, if the drafter has them, the probabilities they came from.

    tokens: [k] int64.
    q: [k, vocab_size] float32, row i the distribution tokens[i] was sampled
       from; None means a point mass on each token (exact all the same).
    kind: which kind of proposal this is, for acceptance estimated per kind
       (n-gram lookup: the length of the matched n-gram; 0: one kind only).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    kind: int = 0

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, n: int) -> Draft:
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], self.kind)

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long))


@runtime_checkable
class Drafter(Protocol):
    name: str

    def begin(
        self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator
    ) -> None:
        """Start a new request: forget per-request state; sample with these params."""
        ...

    def propose(self, context: list[int], k: int) -> Draft:
        """Up to k tokens likely to follow `context` (fewer, or none, is fine)."""
        ...

    def observe(self, num_accepted: int) -> None:
        """The verifier kept `num_accepted` tokens of the last draft."""
        ...
