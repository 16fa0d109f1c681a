"""Per-request state (engine.Request), the drafter context and the verifier protocol.

Two requests stepped in turn on one decoder must each get what they get alone:
nothing of a request lives in the decoder, its drafters' sampling or its
controller estimates (float32 tiny models; exact equality).
"""

from __future__ import annotations

import pytest
import torch

from conftest import plain_greedy, tiny
from specdecode import (
    BaseDrafter,
    Draft,
    DraftContext,
    DraftModelDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeDecoder,
)
from specdecode.controller import Controller, Slot
from specdecode.speclen import CostModel, LengthPolicy
from specdecode.verify import GreedyVerifier, SamplingVerifier, VerifyResult, make_verifier


def _alone(decoder, prompt, params, seed):
    return decoder.generate(prompt, params, seed=seed).token_ids


def _interleaved(decoder, jobs):
    """Start every (prompt, params, seed) job, then step them round-robin to the end."""
    requests = [decoder.start(p, params, seed=seed) for p, params, seed in jobs]
    live = list(requests)
    while live:
        for request in list(live):
            if decoder.step(request).finish_reason:
                live.remove(request)
    return [r.output for r in requests]


def _decoders(target):
    draft = tiny(seed=2)
    prior = CostModel({1: 1.0, 3: 1.5, 9: 3.0}, draft_per_token=0.2)
    slots = [Slot(NgramDrafter(max_n=2), LengthPolicy(CostModel(prior.verify)), False),
             Slot(DraftModelDrafter(draft, target), LengthPolicy(prior), True)]
    return {
        "draft model": SpeculativeDecoder(target, DraftModelDrafter(draft, target), k=4),
        "n-gram": SpeculativeDecoder(target, NgramDrafter(max_n=2), k=6),
        "controller": SpeculativeDecoder(target, k=6, controller=Controller(
            slots, prior, online=False)),
    }


@pytest.mark.parametrize("name", ["draft model", "n-gram", "controller"])
def test_two_requests_stepped_in_turn_get_what_they_get_alone(target, name):
    """Greedy and seeded samples. With the controller only greedy: at T > 0 its
    seeded sample depends on which drafter each step used (pauses and learnt
    costs are the machine's, so interleaving moves them), exact in law either way."""
    decoder = _decoders(target)[name]
    sampled = [([7, 7, 1, 2], SamplingParams(temperature=0.8, top_k=50, max_tokens=35,
                                             ignore_eos=True), 11),
               ([5], SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True), 3)]
    greedy = [([9, 4, 9, 4, 9], SamplingParams(max_tokens=30, ignore_eos=True), None),
              ([2], SamplingParams(max_tokens=25, ignore_eos=True), None)]
    jobs = [([3, 141, 59, 26, 3, 141], SamplingParams(max_tokens=40, ignore_eos=True), None),
            *(greedy if name == "controller" else sampled)]
    alone = [_alone(decoder, p, params, seed) for p, params, seed in jobs]
    assert alone[0] == plain_greedy(target, jobs[0][0], 40)
    assert _interleaved(decoder, jobs) == alone


def test_a_finished_request_cannot_be_stepped_and_stream_finishes_it(target):
    decoder = SpeculativeDecoder(target, NgramDrafter(), k=4)
    request = decoder.start([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while not decoder.step(request).finish_reason:
        pass
    assert request.finished and len(request.output) == 3
    with pytest.raises(ValueError, match="finished"):
        decoder.step(request)


class Recorder(BaseDrafter):
    """A drafter that records its contexts and always proposes the same wrong token."""

    name = "recorder"
    hidden_layers = ()

    def __init__(self) -> None:
        self.contexts: list[DraftContext] = []
        self.finished: list[list[int]] = []

    def propose(self, ctx: DraftContext) -> Draft:
        self.contexts.append(ctx.with_k(ctx.k))
        self.contexts[-1].tokens = list(ctx.tokens)  # the live list grows: keep a copy
        return Draft(torch.full((ctx.k,), 0, dtype=torch.long))

    def finish(self, output_ids: list[int]) -> None:
        self.finished.append(output_ids)


def test_the_drafter_context_carries_the_last_pass_and_finish_hears_the_output(target):
    drafter = Recorder()
    decoder = SpeculativeDecoder(target, drafter, k=3)
    params = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    out = decoder.generate([4, 5, 6], params, seed=1)
    first, later = drafter.contexts[0], drafter.contexts[1:]
    assert first.last is None and first.target is None and first.k == 3
    assert first.params is params and first.prompt_len == 3
    for ctx in later:
        assert isinstance(ctx.last, VerifyResult)
        rows = ctx.last.num_accepted + 1
        assert ctx.target.logits.shape == (rows, target.vocab_size)
        assert ctx.tokens[-rows:] == list(ctx.last.tokens)
    assert drafter.finished == [out.token_ids]


def test_the_custom_drafter_of_the_readme_is_lossless(target):
    class RepeatLast(BaseDrafter):
        name = "repeat-last"

        def propose(self, ctx: DraftContext) -> Draft:
            k = 1 if ctx.last is not None and ctx.last.num_accepted == 0 else ctx.k
            return Draft(torch.full((k,), ctx.tokens[-1], dtype=torch.long))

    decoder = SpeculativeDecoder(target, RepeatLast(), k=4)
    request = decoder.start([1, 2, 3], SamplingParams(max_tokens=16, ignore_eos=True))
    tokens = []
    while True:
        event = decoder.step(request)
        tokens += event.token_ids
        if event.finish_reason:
            break
    assert tokens == plain_greedy(target, [1, 2, 3], 16)


def test_a_verifier_is_chosen_once_per_request_and_can_be_replaced(target):
    assert isinstance(make_verifier(SamplingParams(temperature=0), 1, None), GreedyVerifier)
    assert isinstance(make_verifier(SamplingParams(temperature=0.5), 1, None), SamplingVerifier)
    made = []

    def factory(params, key, generator):
        made.append(params.temperature)
        return make_verifier(params, key, generator)

    decoder = SpeculativeDecoder(target, NgramDrafter(), k=4, verifier=factory)
    decoder.generate([1, 2, 1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    decoder.generate([1, 2], SamplingParams(temperature=0.9, max_tokens=5), seed=0)
    assert made == [0.0, 0.9]


def test_tree_drafts_are_described_but_refused_until_tree_verification(target):
    chain = Draft(torch.tensor([5, 6, 7]), parents=torch.tensor([-1, 0, 1]))
    tree = Draft(torch.tensor([5, 6, 7]), parents=torch.tensor([-1, -1, 0]))
    assert chain.is_chain and not tree.is_chain and Draft(torch.tensor([1])).is_chain
    assert tree.truncate(2).parents.tolist() == [-1, -1]

    class TreeDrafter(BaseDrafter):
        def propose(self, ctx):
            return tree

    decoder = SpeculativeDecoder(target, TreeDrafter(), k=3)
    with pytest.raises(NotImplementedError, match="tree"):
        decoder.generate([1, 2], SamplingParams(max_tokens=4))


def test_a_drafter_that_asks_for_target_layers_gets_them_at_the_accepted_rows(target):
    """hidden_layers on the drafter: the engine asks the target's pass for them and
    hands the accepted rows on; they equal a fresh prefill's states at those
    positions (float32)."""
    from specdecode.models.base import FINAL_LAYER

    class Features(Recorder):
        hidden_layers = (0, FINAL_LAYER)

    drafter = Features()
    decoder = SpeculativeDecoder(target, drafter, k=2)
    out = decoder.generate([4, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True))
    assert out.token_ids == plain_greedy(target, [4, 5, 6], 10)
    ctx = drafter.contexts[-1]
    rows = ctx.last.num_accepted + 1
    sequence = ctx.tokens  # its last `rows` tokens came from the last pass
    fresh = tiny(seed=1).prefill(torch.tensor(sequence[:-1]), hidden_layers=(0, FINAL_LAYER))
    for layer in (0, FINAL_LAYER):
        got = ctx.target.hidden[layer]  # [rows, hidden]
        assert got.shape[0] == rows
        assert torch.allclose(got[-1], fresh.hidden_states[layer][-1], atol=1e-5)
