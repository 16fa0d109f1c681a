"""Shared fixtures: tiny seeded random models (float32, CPU) and scripted drafters."""

from __future__ import annotations

import os

import pytest
import torch

from specdecode import Draft, SamplingParams, SpeculativeDecoder
from specdecode.models import PRESETS, Transformer

torch.set_num_threads(1)
# The tests name their backend; where llama-cpp-python is installed, "auto" would pick
# it for GGUF files, so loads that do not say (CLI and server subprocesses included)
# stay on the PyTorch path the float32 exactness tests are about.
os.environ.setdefault("SPECDECODE_BACKEND", "torch")


def tiny(seed: int, preset: str = "tiny", **kw) -> Transformer:
    return Transformer.random(PRESETS[preset], seed=seed, **kw)


def plain_greedy(target: Transformer, prompt: list[int], max_tokens: int, **kw) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
    # a fresh prefill: the reference does not depend on what earlier tests left cached
    return SpeculativeDecoder(target, None, prefix_cache=False).generate(prompt, params).token_ids


class OracleDrafter:
    """Scripted drafter: knows the target's greedy sequence `truth` (prompt + output).

    Each step it proposes `script[step]` correct tokens followed by wrong ones
    (correct + 1 mod vocab); without a script it is always wrong.
    """

    name = "oracle"

    def __init__(self, truth: list[int], vocab_size: int, script: list[int] | None = None):
        self.truth, self.vocab_size, self.script = truth, vocab_size, script
        self.step = 0

    def begin(self, prompt_ids, params, generator) -> None:
        self.step = 0

    def propose(self, ctx) -> Draft:
        context, k = ctx.tokens, ctx.k
        assert context == self.truth[: len(context)], "context left the greedy path"
        right = self.truth[len(context) : len(context) + k]
        n_right = self.script[self.step] if self.script else 0
        tokens = [t if i < n_right else (t + 1) % self.vocab_size for i, t in enumerate(right)]
        self.step += 1
        return Draft(torch.tensor(tokens, dtype=torch.long))

    def observe(self, num_accepted: int) -> None:
        pass


@pytest.fixture(scope="session")
def target() -> Transformer:
    return tiny(seed=1)
