"""Prompt-prefix reuse: a new request whose prompt starts with what the target's cache
holds (an earlier turn's prompt + answer) prefills only the rest, and decodes exactly
what a fresh prefill decodes (float32 torch; llama.cpp in test_llama_cpp.py).

CausalLM.cached_ids follows every cache operation (forward, rollback, tree pass + keep,
forward_many, prefill), on both backends: it is what the engine trusts to skip work.
"""

from __future__ import annotations

import pytest
import torch

import real
from conftest import OracleDrafter, tiny
from specdecode import NgramDrafter, SamplingParams, SpeculativeDecoder
from specdecode.drafters.base import BaseDrafter, Draft
from specdecode.models.base import FINAL_LAYER
from test_keep import PARENTS, PREFIX, TOKENS, tree_inputs


def check_cached_ids(model) -> None:
    """cached_ids == the tokens fed, position by position, after each operation."""
    want = PREFIX.tolist()
    model.prefill(PREFIX)
    assert model.cached_ids == want
    model.forward(torch.tensor([1, 2, 3]))
    assert model.cached_ids == want + [1, 2, 3] and model.cached_len == len(want) + 3
    model.rollback(len(want) + 1)
    assert model.cached_ids == want + [1]
    model.rollback(len(want))
    positions, mask = tree_inputs(PARENTS, len(want))
    model.forward(TOKENS, positions=positions, tree_mask=mask)
    model.keep([len(want) + 0, len(want) + 2], start=len(want))  # nodes 0 -> 2
    assert model.cached_ids == want + [int(TOKENS[0]), int(TOKENS[2])]
    other = model.sequence(1)
    other.prefill(torch.tensor([4, 4]))
    model.forward_many([(model, torch.tensor([8])), (other, torch.tensor([9, 10]))])
    assert model.cached_ids == want + [int(TOKENS[0]), int(TOKENS[2]), 8]
    assert other.cached_ids == [4, 4, 9, 10] and other.cached_len == 4
    model.prefill(torch.tensor([6]))
    assert model.cached_ids == [6]


def test_cached_ids_follow_the_cache_torch():
    check_cached_ids(tiny(1))


def test_reuse_from_bounds_the_new_part_to_bucket_lengths():
    from specdecode.models.transformer import prefill_bucket

    model = tiny(1)
    assert model.reuse_from(100, 150) == 100  # <= 65 new tokens: shapes verification has
    assert model.reuse_from(300, 300) == 300
    start = model.reuse_from(100, 450)  # 350 new: run as a prefill bucket (<= 12.5 % more)
    assert 100 - 350 // 8 <= start < 100
    assert prefill_bucket(450 - start, 512) == 450 - start


def turns(target, decoder_of, prompt: list[int], extra: list[list[int]], n: int):
    """An agent-like conversation: each turn's prompt is the last prompt + its answer +
    new tokens. Returns each turn's (output ids, cached_tokens)."""
    out = []
    for more in [[]] + extra:
        if out:
            prompt = prompt + out[-1][0] + more
        result = decoder_of(target).generate(
            prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        out.append((result.token_ids, result.stats.cached_tokens))
    return out


EXTRA = [[17, 4, 250, 9], [3, 3, 81, 64, 12, 5, 200, 7]]


@pytest.mark.parametrize("k", [0, 4])
def test_turns_reuse_the_cache_and_decode_as_a_fresh_prefill(k):
    """Turn 2+ reuses prompt + answer of the turn before (all but the last answer token,
    which was pending) and decodes what a decoder with the prefix cache off decodes."""
    prompt = [5, 9, 200, 31, 7, 77, 3, 42, 11, 19]

    def decoder(prefix_cache):
        return lambda t: SpeculativeDecoder(t, NgramDrafter() if k else None, k,
                                            prefix_cache=prefix_cache)

    reused = turns(tiny(3), decoder(True), prompt, EXTRA, 20)
    fresh = turns(tiny(3), decoder(False), prompt, EXTRA, 20)
    assert [ids for ids, _ in reused] == [ids for ids, _ in fresh]
    assert [c for _, c in fresh] == [0, 0, 0]
    assert reused[0][1] == 0
    assert reused[1][1] == len(prompt) + 20 - 1  # prompt + answer but its pending token
    assert reused[2][1] == len(prompt) + 20 + len(EXTRA[0]) + 20 - 1


def test_real_float32_turns_equal_a_fresh_prefill():
    """SmolLM2-135M float32 with the n-gram drafter: three turns with the cache reused equal
    three fresh prefills token for token."""
    llm = real.load("smollm2-135m")
    prompt = llm.tokenizer.encode("def quicksort(xs):\n    \"\"\"Sort a list.\"\"\"\n")
    extra = [llm.tokenizer.encode("\n\n# Now write it without recursion.\n"),
             llm.tokenizer.encode("\n\n# And add type hints.\n")]

    def decoder(prefix_cache):
        return lambda t: SpeculativeDecoder(t, NgramDrafter(), 6, prefix_cache=prefix_cache)

    reused = turns(llm.model, decoder(True), prompt, extra, 32)
    fresh = turns(llm.model, decoder(False), prompt, extra, 32)
    assert [ids for ids, _ in reused] == [ids for ids, _ in fresh]
    assert all(c > len(prompt) for _, c in reused[1:])


class Counting:
    """A target that counts the tokens each request's prefill runs (the engine reads
    cached_ids / reuse_from through it)."""

    def __init__(self, model) -> None:
        self.model, self.fed = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, ids, **kw):
        self.fed += len(ids)
        return self.model.forward(ids, **kw)

    def prefill(self, ids, **kw):
        self.fed += len(ids)
        return self.model.prefill(ids, **kw)


def test_interleaved_requests_prefill_only_where_they_part():
    """Two requests with a shared 40-token prefix stepped in turn: each switch re-runs the
    tokens after the shared prefix only, and both outputs equal their sequential runs."""
    shared = list(range(100, 140))
    a, b = shared + [7, 8, 9], shared + [50, 51]
    target = Counting(tiny(2))
    truth = {}
    for p in (a, b):
        truth[tuple(p)] = SpeculativeDecoder(target, None, 0, prefix_cache=False).generate(
            p, SamplingParams(max_tokens=6, ignore_eos=True)).token_ids
    dec = SpeculativeDecoder(target, None, 0)
    ra = dec.start(a, SamplingParams(max_tokens=6, ignore_eos=True))
    rb = dec.start(b, SamplingParams(max_tokens=6, ignore_eos=True))
    assert rb.stats.cached_tokens == len(shared)
    target.fed = 0
    outs: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(6):
        for i, r in enumerate((ra, rb)):
            before = target.fed
            outs[i] += dec.step(r).token_ids
            # a switch re-runs its own part after the shared prefix, then the step's token
            assert target.fed - before <= len(r.context) - len(shared) + 1
    assert outs[0] == truth[tuple(a)] and outs[1] == truth[tuple(b)]


class StateReader(BaseDrafter):
    """A drafter that reads the target's final hidden state: the first step of a request
    must have it even when the whole prompt was cached."""

    name = "state-reader"
    hidden_layers = (FINAL_LAYER,)

    def propose(self, ctx):
        assert ctx.target is not None and FINAL_LAYER in ctx.target.hidden
        return Draft.empty()


def test_fully_cached_prompt_still_gives_the_first_step_its_state():
    target = tiny(4)
    prompt = [5, 9, 200, 31, 7, 77, 3, 42]
    dec = SpeculativeDecoder(target, StateReader(), 2)
    first = dec.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    again = dec.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert again.token_ids == first.token_ids
    assert again.stats.cached_tokens == len(prompt) - 2  # the last prompt token ran again


def test_a_forced_wrong_drafter_leaves_a_consistent_cache():
    """Rejected drafts are rolled back out of cached_ids too: the next turn reuses only
    accepted tokens and matches a fresh prefill."""
    target = tiny(5)
    prompt = [5, 9, 200, 31, 7, 77]
    plain = SpeculativeDecoder(target, None, 0).generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    truth = prompt + plain
    wrong = SpeculativeDecoder(target, OracleDrafter(truth, target.vocab_size), 4)
    got = wrong.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert got.token_ids == plain
    assert target.cached_ids == truth[:-1]
