"""Verifier golden cases on hand-built logits / probabilities."""

from __future__ import annotations

import torch
from scipy.stats import kstest

from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.drafters import Draft
from specdecode.sampling import position_uniform, sample_at
from specdecode.verify import greedy_verify, match_sample, rejection_sample

V = 5


def logits_with_argmax(argmaxes: list[int]) -> torch.Tensor:  # [len, V]
    logits = torch.zeros(len(argmaxes), V)
    for row, a in enumerate(argmaxes):
        logits[row, a] = 3.0
    return logits


def probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_all_accepted_plus_bonus():
    r = greedy_verify(torch.tensor([1, 2, 3]), logits_with_argmax([1, 2, 3, 4]))
    assert (r.num_accepted, r.next_token, r.tokens) == (3, 4, (1, 2, 3, 4))


def test_greedy_first_rejected():
    r = greedy_verify(torch.tensor([1, 2, 3]), logits_with_argmax([0, 2, 3, 4]))
    assert (r.num_accepted, r.next_token, r.tokens) == (0, 0, (0,))


def test_greedy_middle_rejected():
    r = greedy_verify(torch.tensor([1, 2, 3]), logits_with_argmax([1, 4, 3, 4]))
    assert (r.num_accepted, r.next_token, r.tokens) == (1, 4, (1, 4))


def test_greedy_empty_draft_is_plain_step():
    r = greedy_verify(torch.zeros(0, dtype=torch.long), logits_with_argmax([2]))
    assert (r.num_accepted, r.tokens) == (0, (2,))


def test_greedy_tie_takes_first_index_like_argmax():
    logits = torch.tensor([[1.0, 5.0, 5.0, 0.0, 0.0], [0.0] * 5])
    assert greedy_verify(torch.tensor([2]), logits).tokens == (1,)


def test_rejection_point_mass_certain_accept_and_bonus():
    # p puts all mass on the draft tokens: always accepted; bonus from p[k].
    p = probs([[0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 1]])
    r = rejection_sample(torch.tensor([1, 2]), p, None, torch.Generator().manual_seed(0))
    assert r.tokens == (1, 2, 4)


def test_rejection_first_rejected_recovers_from_residual():
    # p(x=1) = 0: the draft token is always rejected; the residual
    # max(0, p - q) puts all its mass on token 3.
    p = probs([[0, 0, 0.4, 0.6, 0], [0.2] * 5, [0.2] * 5])
    q = probs([[0, 0.5, 0.5, 0, 0], [0.2] * 5])
    r = rejection_sample(torch.tensor([1, 0]), p, q, torch.Generator().manual_seed(0))
    assert r.tokens == (3,)


def test_rejection_middle_rejected():
    p = probs([[0, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0.2] * 5])
    q = probs([[0, 1, 0, 0, 0], [0, 0, 1, 0, 0]])
    r = rejection_sample(torch.tensor([1, 2]), p, q, torch.Generator().manual_seed(0))
    assert (r.num_accepted, r.tokens) == (1, (1, 0))


def test_rejection_empty_draft_samples_p():
    p = probs([[0, 0, 0, 1, 0]])
    r = rejection_sample(torch.zeros(0, dtype=torch.long), p, None, torch.Generator())
    assert r.tokens == (3,)


def test_rejection_is_reproducible_with_a_seed():
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(2)), -1)
    draft = torch.tensor([0, 1, 2])
    runs = [rejection_sample(draft, p, q, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def _uniforms(key: int):
    return lambda i: position_uniform(key, i)


def test_match_keeps_drafts_the_target_draws_then_emits_its_own():
    p = probs([[0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 1]])
    assert match_sample(torch.tensor([1, 2]), p, _uniforms(0)).tokens == (1, 2, 4)
    r = match_sample(torch.tensor([1, 3]), p, _uniforms(0))  # row 1 draws 2, not 3
    assert (r.num_accepted, r.tokens) == (1, (1, 2))
    assert match_sample(torch.zeros(0, dtype=torch.long), p[:1], _uniforms(0)).tokens == (1,)


def test_match_draws_each_row_with_its_own_uniform():
    """Row i's token is sample_at(p_i, uniforms(i)): the draw plain decoding
    makes at that position, whatever the draft."""
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(1)), -1)
    own = [sample_at(p[i], position_uniform(5, i)) for i in range(4)]
    for draft in ([own[0], own[1], own[2]], [own[0], (own[1] + 1) % V, 0], [(own[0] + 1) % V]):
        r = match_sample(torch.tensor(draft), p[:len(draft) + 1], _uniforms(5))
        assert list(r.tokens) == own[:len(r.tokens)]


def test_position_uniforms_are_fixed_by_key_and_position_and_look_uniform():
    assert position_uniform(7, 10) == position_uniform(7, 10)
    # all 64 bits of the key matter (a CPU torch.Generator keeps only 32 of its seed)
    assert position_uniform(1, 0) != position_uniform(1 + 2**32, 0)
    u = torch.tensor([position_uniform(key, pos) for key in (0, 1, 2**40) for pos in range(4000)],
                     dtype=torch.float64)
    assert len(set(u.tolist())) == len(u) and u.min() >= 0 and u.max() < 1
    assert kstest(u.numpy(), "uniform").pvalue > 1e-3


def test_sample_at_follows_the_cumulative_distribution_and_skips_zeros():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    assert [sample_at(p, u) for u in (0.0, 0.2499, 0.25, 0.9999)] == [1, 1, 3, 3]


class FixedDrafter:
    """Proposes the same tokens every step."""

    name = "fixed"

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def begin(self, prompt_ids, params, generator):
        pass

    def propose(self, ctx):
        k = ctx.k
        return Draft(torch.tensor(self.tokens[:k], dtype=torch.long))

    def observe(self, num_accepted):
        pass


class ScriptedTarget:
    """A CausalLM whose next-token argmax is read from a table, whatever the input.

    Position i (0-based in the whole sequence) predicts `script[i + 1]`.
    """

    vocab_size = V
    max_seq_len = 64
    eos_token_ids = (4,)
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, script: list[int]):
        self.script, self._len = script, 0

    @property
    def cached_len(self):
        return self._len

    def forward(self, ids, *, last_n=None, **_):
        from specdecode.models import ForwardOutput

        start, self._len = self._len, self._len + len(ids)
        rows = [self.script[min(start + i + 1, len(self.script) - 1)] for i in range(len(ids))]
        logits = logits_with_argmax(rows)
        return ForwardOutput(logits if last_n is None else logits[len(ids) - last_n:])

    def prefill(self, ids):
        self._len = 0
        return self.forward(ids, last_n=1)

    def rollback(self, length):
        assert 0 <= length <= self._len
        self._len = length


def test_eos_inside_draft_nothing_after_is_emitted_or_counted():
    # Prompt [0]; the target then says 1, 2, EOS(4), 3, 3... and the drafter
    # proposes exactly that, so the whole draft would be accepted.
    target = ScriptedTarget([0, 1, 2, 4, 3, 3, 3, 3])
    decoder = SpeculativeDecoder(target, FixedDrafter([1, 2, 4, 3, 3]), k=5)
    result = decoder.generate([0], SamplingParams(max_tokens=10))
    assert result.token_ids == [1, 2, 4]
    assert result.finish_reason == "stop"
    stats = result.stats
    assert (stats.steps, stats.drafted, stats.accepted, stats.emitted) == (1, 3, 3, 3)
    assert stats.position_acceptance == [1.0, 1.0, 1.0]
