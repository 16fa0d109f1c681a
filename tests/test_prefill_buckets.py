"""Bounded prompt shapes: a server that sees every prompt length once must not
keep one set of CPU kernels (and their memory) per length.

The torch server grew ~8.4 MB of RSS per new prompt length (1.07 -> 2.17 GB
over ~800 requests) while 40 requests of one length stayed flat: per-shape
kernel/primitive caches. Fresh prompts now run at bucketed lengths
(`prefill_bucket`), padded after the prompt where causal attention keeps the
padding out of the prompt's rows.

- the bucket table: few sizes, little padding, never beyond the context;
- padding changes no token: the padded prefill's logits and cache agree with an
  unpadded one to float32 rounding, and greedy speculative output still equals
  plain decoding token for token (both prefill the same way);
- 60 distinct prompt lengths through the server run at 17 prompt shapes;
- (slow) the RSS of `specdecode serve` on torch plateaus over 60 new lengths.
"""

from __future__ import annotations

import pytest
import torch

from conftest import plain_greedy, tiny
from server_util import ProcessServer, ThreadServer, client, smol_llm
from specdecode import NgramDrafter, SamplingParams, SpeculativeDecoder
from specdecode.models import transformer
from specdecode.models.transformer import prefill_bucket

LENGTHS = range(20, 320, 5)  # 60 distinct prompt lengths


def test_bucket_table():
    sizes = {prefill_bucket(t, 8192) for t in range(2, 8193)}
    assert len(sizes) <= 56
    for t in range(2, 8193):
        b = prefill_bucket(t, 8192)
        assert t <= b <= 8192
        assert b - t < 16 or (b - t) / t <= 0.125
    assert prefill_bucket(300, 310) == 310 and prefill_bucket(310, 310) == 310
    assert [prefill_bucket(t, 4096) for t in (2, 16, 17, 256, 257, 1000)] == [
        16, 16, 32, 256, 288, 1024]


@pytest.mark.parametrize("t", [2, 7, 17, 40, 129, 200])
def test_padding_stays_out_of_the_prompt(t, monkeypatch):
    model = tiny(3, max_seq_len=256)
    ids = torch.randint(1, 256, (t,), generator=torch.Generator().manual_seed(t))
    padded = model.prefill(ids).logits
    keys = model.k_cache[0][:, :t].clone()
    step = model.forward(torch.tensor([5, 6])).logits
    assert model.cached_len == t + 2
    monkeypatch.setattr(transformer, "prefill_bucket", lambda t, limit: t)  # the old path
    exact = model.prefill(ids).logits
    torch.testing.assert_close(padded, exact, rtol=0, atol=1e-4)
    torch.testing.assert_close(model.k_cache[0][:, :t], keys, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.forward(torch.tensor([5, 6])).logits, step, rtol=0,
                               atol=1e-4)


def test_greedy_speculation_still_equals_plain_at_every_bucket_edge():
    target = tiny(1)
    decoder = SpeculativeDecoder(target, NgramDrafter(max_n=3, min_n=1), k=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    for t in (2, 16, 17, 18, 33, 100):
        prompt = [(i * 37) % 50 + 1 for i in range(t)]
        assert decoder.generate(prompt, params).token_ids == plain_greedy(target, prompt, 12)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_server_runs_few_prompt_shapes(prefix_cache):
    """60 distinct prompt lengths (20..315 tokens; 19..314 are prefilled) run at
    17 shapes of prompt rows (multiples of 16 from 32 to 256, then 288, 320). With the
    prefix cache on, each prompt here extends the last: only its new tokens run, at
    most a verification pass's length (65) or else at a bucket length."""
    llm = smol_llm()  # (one LLM shared by the test modules: its setting is put back)
    before = llm.decoder.prefix_cache, llm.plain.prefix_cache
    llm.decoder.prefix_cache = llm.plain.prefix_cache = prefix_cache
    llm.target.rollback(0)
    shapes: set[int] = set()
    hook = llm.target.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda module, args: shapes.add(args[0].shape[1]))
    try:
        with ThreadServer(llm, model_name="smol") as s, client(s.url) as http:
            for n in LENGTHS:
                r = http.post("/v1/completions", json={
                    "model": "smol", "prompt": [100 + i for i in range(n)], "max_tokens": 2,
                    "temperature": 0})
                assert r.status_code == 200, r.text
    finally:
        hook.remove()
        llm.decoder.prefix_cache, llm.plain.prefix_cache = before
    prompt_shapes = {t for t in shapes if t > llm.k + 1}
    if prefix_cache:
        assert prompt_shapes and all(t <= 65 or prefill_bucket(t, 1024) == t
                                     for t in prompt_shapes), sorted(prompt_shapes)
        return
    assert prompt_shapes == {prefill_bucket(n - 1, 1024) for n in LENGTHS}, sorted(prompt_shapes)
    assert len(prompt_shapes) == 17


def _rss_after(http, s, lengths) -> int:
    for n in lengths:
        r = http.post("/v1/completions", json={
            "model": "default", "prompt": [100 + (7 * i) % 900 for i in range(n)],
            "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    return s.rss()


@pytest.mark.slow
def test_torch_server_rss_plateaus_over_new_prompt_lengths():
    """Two rounds of 60 prompt lengths each, none repeated: the second round's
    lengths are all new, so without bounded shapes it adds 60 more kernel sets
    (~500 MB at the reported 8.4 MB each); its RSS must stay within 48 MiB.
    bf16 (the default, where oneDNN's kernels serve the matmuls) on CPUs with
    AVX-512; float32 elsewhere, where bf16 matmuls are 5x slower (AVX2: 2-5 min)."""
    fast_bf16 = "AVX512" in torch.backends.cpu.get_cpu_capability()
    with ProcessServer("--target", "smollm2-135m", "--backend", "torch", "--drafter", "ngram",
                       "-k", "4", "--max-context", "1024",
                       "--dtype", "bfloat16" if fast_bf16 else "float32") as s, \
            client(s.url, timeout=120) as http:
        _rss_after(http, s, [10])
        first = _rss_after(http, s, LENGTHS)
        second = _rss_after(http, s, [n + 2 for n in LENGTHS])
    growth = second - first
    assert growth < 48 << 20, f"RSS grew {growth >> 20} MiB over 60 new prompt lengths"
