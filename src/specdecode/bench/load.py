"""Adverse conditions for benchmarks: a busy machine, drafts that are always wrong.

`busy_load(n)` starts n processes that each keep one CPU busy (as a browser,
an IDE or a build would) until the context ends; benchmarks start it after
their warm-up, so every configuration runs under the same load, interleaved.
`WrongDrafts` wraps a drafter so that every token it proposes is wrong (the
worst case the "never slower than plain" promise must survive).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

from specdecode.drafters.base import Draft, DraftContext


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_load(n: int) -> Iterator[list]:
    """n busy processes for the duration of the block (n = 0: none)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
            proc.join(10)


class WrongDrafts:
    """A drafter whose every proposal is the wrapped drafter's, each token shifted
    by one (mod the vocabulary): never what the target would emit at T = 0. Its
    costs (a draft model's forwards, `pending`, `timing`) are the wrapped one's."""

    def __init__(self, drafter, vocab_size: int) -> None:
        self.inner, self.vocab_size = drafter, vocab_size

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, ctx: DraftContext) -> Draft:
        draft = self.inner.propose(ctx)
        return Draft((draft.tokens + 1) % self.vocab_size, draft.q, draft.kind)  # tokens: [k] int64

    def observe(self, num_accepted: int) -> None:
        self.inner.observe(num_accepted)


def force_wrong_drafts(decoder) -> None:
    """Make every drafter of a SpeculativeDecoder (its controller's or its own) wrong."""
    vocab = decoder.target.vocab_size
    controller = decoder.controller
    if controller is not None:
        for slot in controller.slots:
            slot.drafter = WrongDrafts(slot.drafter, vocab)
    elif decoder.drafter is not None:
        decoder.drafter = WrongDrafts(decoder.drafter, vocab)
