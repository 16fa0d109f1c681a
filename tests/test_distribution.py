"""Speculative sampling preserves the target's distribution (chi-square tests).

The joint distribution of the first two generated tokens with speculation is
compared with the exact plain-sampling distribution, computed from the
target's own probabilities. Seeds are fixed, so the tests cannot flake; a
deliberately broken verifier (always accept) must fail the same test.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specdecode import Draft, DraftModelDrafter, SamplingParams, SpeculativeDecoder
from specdecode.drafters import SuffixDrafter, SuffixStore
from specdecode.models import ModelConfig, Transformer
from specdecode.sampling import logits_to_probs
from specdecode.verify import SamplingVerifier, VerifyResult
from toy_lm import TableLM

V = 6
PROMPT = [1, 2, 3]
N_SAMPLES = 20_000


def exact_joint(target, params: SamplingParams) -> torch.Tensor:  # [V, V]
    """P(first token = a, second = b) under plain sampling, from the target's probs."""
    p1 = logits_to_probs(target.prefill(torch.tensor(PROMPT)).logits[0], params)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        p2 = logits_to_probs(target.prefill(torch.tensor(PROMPT + [a])).logits[0], params)
        joint[a] = p1[a].double() * p2.double()
    return joint


def sample_joint(decoder, params: SamplingParams, n: int) -> torch.Tensor:  # [V, V]
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seed in range(n):
        out = decoder.generate(PROMPT, params, seed=seed).token_ids
        counts[out[0], out[1]] += 1
    return counts


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; cells expecting < 5 samples are pooled."""
    n = counts.sum()
    expected, observed = (probs * n).flatten(), counts.flatten()
    assert observed[expected == 0].sum() == 0, "sampled a token the target forbids"
    small = expected < 5
    exp = torch.cat((expected[~small], expected[small].sum().reshape(1)))
    obs = torch.cat((observed[~small], observed[small].sum().reshape(1)))
    keep = exp > 0
    exp = exp[keep] * (obs[keep].sum() / exp[keep].sum())  # exact same total for scipy
    return float(chisquare(obs[keep].numpy(), exp.numpy()).pvalue)


class RandomTokenDrafter:
    """Proposes uniformly random tokens and reports no q (a point mass): still exact."""

    name = "random"

    def begin(self, prompt_ids, params, generator):
        self.generator = generator

    def propose(self, ctx):
        k = ctx.k
        return Draft(torch.randint(0, V, (k,), generator=self.generator))

    def observe(self, num_accepted):
        pass


class TableDrafter(DraftModelDrafter):
    """The draft-model drafter over a TableLM draft model."""


def always_accept(draft_tokens, p, q, generator) -> VerifyResult:
    """A broken verifier: keeps every draft token (the negative control)."""
    from specdecode.sampling import sample

    k = draft_tokens.shape[0]
    kept = tuple(int(t) for t in draft_tokens.tolist())
    bonus = sample(p[k], generator)
    return VerifyResult(k, bonus, kept + (bonus,))


CONFIGS = {
    # name: (k, drafter kind, sampling params)
    "T1-k1-draft-model": (1, "model", SamplingParams(temperature=1.0, max_tokens=2)),
    "T1-k3-draft-model": (3, "model", SamplingParams(temperature=1.0, max_tokens=4)),
    "T1-k3-no-q": (3, "random", SamplingParams(temperature=1.0, max_tokens=4)),
    "T0.8-topk3-topp0.9-k3": (
        3, "model", SamplingParams(temperature=0.8, top_k=3, top_p=0.9, max_tokens=4)),
    "T1-minp0.1-k2-no-q": (2, "random", SamplingParams(temperature=1.0, min_p=0.1, max_tokens=3)),
    "T1-k3-suffix-store": (3, "suffix", SamplingParams(temperature=1.0, max_tokens=4)),
    "T0.7-topp0.9-k4-suffix-store": (
        4, "suffix", SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5)),
}


def suffix_drafter() -> SuffixDrafter:
    """Suffix lookup with a store of earlier texts: over V = 6 tokens the request's own
    text matches from the second token on, so the drafts are point masses from real
    lookups, most frequent continuation first (the store's texts, random strings, are
    never matched 16 tokens long: tests/test_suffix.py covers the store)."""
    g = torch.Generator().manual_seed(3)
    store = SuffixStore()
    for _ in range(20):
        store.add(PROMPT + torch.randint(0, V, (12,), generator=g).tolist())
    return SuffixDrafter(store)


def make_decoder(k: int, kind: str, target, draft, **kw) -> SpeculativeDecoder:
    drafter = (DraftModelDrafter(draft, target) if kind == "model" else
               suffix_drafter() if kind == "suffix" else RandomTokenDrafter())
    return SpeculativeDecoder(target, drafter, k, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_matches_plain(name):
    k, kind, params = CONFIGS[name]
    target, draft = TableLM(V, seed=10), TableLM(V, seed=11)
    exact = exact_joint(target, params)
    counts = sample_joint(make_decoder(k, kind, target, draft), params, N_SAMPLES)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_plain_sampling_matches_exact():
    """The reference itself: plain sampling through the engine fits the exact joint."""
    params = SamplingParams(temperature=1.0, max_tokens=2)
    target = TableLM(V, seed=10)
    counts = sample_joint(SpeculativeDecoder(target, None), params, N_SAMPLES)
    assert chi_square_pvalue(counts, exact_joint(target, params)) > 1e-3


def test_broken_verifier_fails_the_same_test():
    """Negative control: the test has the power to catch a lossy verifier."""
    k, kind, params = CONFIGS["T1-k3-draft-model"]
    target, draft = TableLM(V, seed=10), TableLM(V, seed=11)
    broken = lambda params, key, generator: SamplingVerifier(  # noqa: E731
        params, key, generator, rejection=always_accept)
    decoder = make_decoder(k, kind, target, draft, verifier=broken)
    counts = sample_joint(decoder, params, N_SAMPLES)
    assert chi_square_pvalue(counts, exact_joint(target, params)) < 1e-6


def test_a_seeded_sample_is_the_same_with_drafts_without_q():
    """Drafts without q (n-gram lookup) never change a seeded sample: every target
    token is drawn with its position's generator, as plain decoding draws it."""
    target = TableLM(V, seed=10)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    plain = SpeculativeDecoder(target, None)
    for kind in ("random", "suffix"):
        spec = make_decoder(3, kind, target, None)
        accepted = 0
        for seed in range(200):
            out = spec.generate(PROMPT, params, seed=seed)
            assert out.token_ids == plain.generate(PROMPT, params, seed=seed).token_ids, seed
            accepted += out.stats.accepted
        assert accepted > 50, kind  # drafts were kept, not only rejected


@pytest.mark.slow
def test_transformer_speculative_sampling_matches_plain():
    """The same check with real transformer target and draft (tiny, float32)."""
    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=32)
    target = Transformer.random(cfg, seed=1, logit_scale=1.0)
    draft = Transformer.random(cfg, seed=2, logit_scale=1.0)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4)
    exact = exact_joint(target, params)
    # 8k samples: the verifier is the one the 20k-sample tests above prove; this one
    # checks that a real transformer pair feeds it consistent p and q
    counts = sample_joint(make_decoder(3, "model", target, draft), params, 8000)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_exact_joint_is_a_distribution():
    params = SamplingParams(temperature=1.0, max_tokens=2)
    joint = exact_joint(TableLM(V, seed=10), params)
    assert abs(float(joint.sum()) - 1.0) < 1e-6
    assert len(list(itertools.product(range(V), repeat=2))) == joint.numel()
