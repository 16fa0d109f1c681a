"""The `CausalLM` protocol: what the engine and drafters need from a model.

A CausalLM holds one sequence's KV cache. `forward` appends new tokens at the
end of the cache and returns logits for the new positions; `rollback` forgets
everything after a given length (for a static cache, moving a pointer), so a
rejected draft costs nothing to undo. Batch size is 1: the workloads this
project serves are one request at a time.

Open for later drafters and verifiers: `return_hidden` gives the final hidden
states (feature-level drafters such as EAGLE), and `positions` + `tree_mask`
let a caller verify a token tree instead of a chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ForwardOutput:
    """Result of one forward pass over T new tokens.

    logits: [n, vocab_size] float32 for the last n new positions (n = last_n or T).
    hidden: [n, hidden_size] final hidden states (after the last norm), if asked.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model with a rollback-able KV cache (batch 1)."""

    vocab_size: int
    max_seq_len: int  # cache capacity in tokens: the context limit
    eos_token_ids: tuple[int, ...]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def cached_len(self) -> int:
        """Number of tokens whose keys/values are in the cache."""
        ...

    def forward(
        self,
        ids: torch.Tensor,  # [T] int64 new tokens, appended at cached_len
        *,
        last_n: int | None = None,
        return_hidden: bool = False,
        positions: torch.Tensor | None = None,  # [T] int64; default cached_len + arange(T)
        tree_mask: torch.Tensor | None = None,  # [T, T] bool; default causal
    ) -> ForwardOutput:
        """Append `ids` to the cache; logits for the last `last_n` new positions."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (0 <= length <= cached_len)."""
        ...

    def prefill(self, ids: torch.Tensor) -> ForwardOutput:  # ids: [T] int64
        """Reset the cache and run `ids`; logits of the last position only."""
        ...
