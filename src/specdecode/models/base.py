"""The `CausalLM` protocol: what the engine and drafters need from a model.

A CausalLM holds one sequence's KV cache. `forward` appends new tokens at the
end of the cache and returns logits for the new positions; `rollback` forgets
everything after a given length (for a static cache, moving a pointer), so a
rejected draft costs nothing to undo; `keep` compacts the cache to the accepted
branch of a token tree.

Sequences: the model object is sequence 0; `sequence(i)` returns a handle that
behaves as an independent CausalLM on the same weights (its own cache, cached
length, rollback and keep), its cache allocated when it is first opened; and
`forward_many([(handle, ids), ...])` runs the new tokens of several sequences in
one pass over the weights.

Hidden states (feature-level drafters such as EAGLE): `hidden_layers` names
the layers a forward returns, for the same positions as the logits. Layer i
(0 <= i < num_layers) is the output of decoder layer i (0-based, the residual
stream before any norm); `FINAL_LAYER` (-1) is the final hidden state after the
last norm, the one the LM head reads. `return_hidden=True` is shorthand for
`hidden_layers=(FINAL_LAYER,)`.

`positions` + `tree_mask` let a caller verify a token tree instead of a chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

FINAL_LAYER = -1  # the final hidden state, after the last norm (what the LM head reads)


@dataclass
class ForwardOutput:
    """Result of one forward pass over T new tokens.

    logits: [n, vocab_size] float32 for the last n new positions (n = last_n or T).
    hidden_states: {layer -> [n, hidden_size]} for the layers asked for (see the
    module docstring for the numbering; FINAL_LAYER is after the last norm).
    hidden: [n, hidden_size] the final hidden state, i.e. hidden_states[FINAL_LAYER]
    (None unless asked for); either field given at construction fills the other.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden is None:
            self.hidden = self.hidden_states.get(FINAL_LAYER)
        elif FINAL_LAYER not in self.hidden_states:
            self.hidden_states[FINAL_LAYER] = self.hidden


def wanted_layers(hidden_layers: Sequence[int], return_hidden: bool, num_layers: int
                  ) -> tuple[int, ...]:
    """The layers a forward returns: `hidden_layers` (+ FINAL_LAYER if return_hidden),
    without duplicates, each checked to be FINAL_LAYER or in 0..num_layers-1."""
    layers = tuple(dict.fromkeys((*hidden_layers, *((FINAL_LAYER,) if return_hidden else ()))))
    for i in layers:
        if not (i == FINAL_LAYER or 0 <= i < num_layers):
            raise ValueError(f"hidden layer {i} does not exist: the model has decoder layers "
                             f"0..{num_layers - 1}, and FINAL_LAYER ({FINAL_LAYER}) is the "
                             "final norm's output")
    return layers


def check_keep(indices: Sequence[int], start: int | None, cached_len: int) -> int:
    """Validate `keep` arguments; returns the start (the length of the prefix kept)."""
    idx = [int(i) for i in indices]
    if start is None:
        if not idx:
            raise ValueError("keep([]) needs start= (the prefix to keep); or use rollback")
        start = idx[0]
    if not 0 <= start <= cached_len:
        raise ValueError(f"keep: start {start} outside the cache of {cached_len} tokens")
    if any(b <= a for a, b in zip(idx, idx[1:])) or (idx and (idx[0] < start
                                                             or idx[-1] >= cached_len)):
        raise ValueError(f"keep: indices must be increasing cache positions in "
                         f"{start}..{cached_len - 1}, got {idx}")
    return start


@dataclass
class CacheSnapshot:
    """A copy of one sequence's cache, taken by a backend's optional
    `snapshot()` and put back by its `restore(snapshot)` (engine prefix store:
    prefix_store.py): the ids at its positions and the backend's own keys and
    values (`data`, opaque), `nbytes` of them."""

    ids: list[int]
    data: object
    nbytes: int


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model with a rollback-able KV cache, one sequence per
    handle (batch 1 per handle; `forward_many` batches several handles)."""

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

    @property
    def cached_ids(self) -> list[int]:
        """The token ids at the cached positions, in order (len == cached_len; read
        only): a new request whose tokens start with some of them reuses their keys
        and values instead of prefilling them again (engine.py). Optional: a model
        without it is prefilled from 0 for every request."""
        ...

    def forward(
        self,
        ids: torch.Tensor,  # [T] int64 new tokens, appended at cached_len
        *,
        last_n: int | None = None,
        hidden_layers: Sequence[int] = (),
        return_hidden: bool = False,  # shorthand for hidden_layers=(FINAL_LAYER,)
        positions: torch.Tensor | None = None,  # [T] int64; default cached_len + arange(T)
        tree_mask: torch.Tensor | None = None,  # [T, T] bool; default causal
    ) -> ForwardOutput:
        """Append `ids` to the cache; logits (and the hidden states of `hidden_layers`)
        for the last `last_n` new positions."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (0 <= length <= cached_len)."""
        ...

    def keep(self, indices: Sequence[int], *, start: int | None = None) -> None:
        """Compact the cache to an accepted branch: keep the first `start` tokens
        (default indices[0]) plus exactly the cached tokens at `indices` (increasing,
        each in start..cached_len-1), moved to be contiguous, so that cached_len
        becomes start + len(indices). Contract: the token at indices[j] was run at
        position start + j (its tree depth), and attended only to the prefix and to
        the earlier kept tokens (its ancestors, by tree_mask); then the cache equals
        that of a fresh prefill of the kept sequence."""
        ...

    def prefill(self, ids: torch.Tensor, *, hidden_layers: Sequence[int] = ()
                ) -> ForwardOutput:  # ids: [T] int64
        """Reset the cache and run `ids`; logits (and hidden states) of the last position."""
        ...

    def sequence(self, index: int) -> CausalLM:
        """Handle on sequence `index` (0: this model) of the same weights, with its own
        cache, allocated on first use."""
        ...

    def forward_many(
        self, items: Sequence[tuple[CausalLM, torch.Tensor]],  # (handle, ids [T_i] int64)
        *, last_n: int | None = None, hidden_layers: Sequence[int] = (),
    ) -> list[ForwardOutput]:
        """Append each ids to its handle's cache in one pass over the weights; outputs
        in the order of `items`, each as that handle's own `forward` would give them
        (up to the rounding of a differently shaped pass)."""
        ...
