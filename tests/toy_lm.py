"""TableLM: a trigram language model as a CausalLM, for fast statistical tests.

Its next-token logits depend only on the previous two tokens, read from a
seeded random table. Forward passes cost microseconds instead of a
transformer's milliseconds, so distribution tests can draw tens of thousands
of samples through the real engine, drafters and verifier.
"""

from __future__ import annotations

import torch

from specdecode.models import ForwardOutput


class TableLM:
    max_seq_len = 64
    eos_token_ids: tuple[int, ...] = ()
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, vocab_size: int, seed: int, scale: float = 1.5):
        self.vocab_size = vocab_size
        gen = torch.Generator().manual_seed(seed)
        self.table = scale * torch.randn(vocab_size, vocab_size, vocab_size, generator=gen)
        self._ids: list[int] = []

    def next_logits(self, seq: list[int]) -> torch.Tensor:  # [vocab]
        a = seq[-2] if len(seq) >= 2 else 0
        return self.table[a, seq[-1]]

    @property
    def cached_len(self) -> int:
        return len(self._ids)

    def forward(self, ids, *, last_n=None, return_hidden=False, positions=None, tree_mask=None):
        start = len(self._ids)
        self._ids.extend(int(t) for t in ids)
        rows = [self.next_logits(self._ids[: start + i + 1]) for i in range(len(ids))]
        logits = torch.stack(rows)
        return ForwardOutput(logits if last_n is None else logits[len(ids) - last_n:])

    def prefill(self, ids):
        self._ids = []
        return self.forward(ids, last_n=1)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= len(self._ids)
        del self._ids[length:]
