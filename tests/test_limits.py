"""Size validation: contexts, draft lengths and memory are checked before allocating.

Each row of the table is a size that once got the process killed by the kernel
(or that cannot work) and must now be a ValueError naming the setting, raised
before the weights or the KV cache are allocated.
"""

from __future__ import annotations

import json

import pytest
import torch

import real
from specdecode import limits
from specdecode.costs import cached_costs
from specdecode.llm import LLM
from specdecode.models import PRESETS, Transformer
from specdecode.models import loading as loading_module
from specdecode.options import MIN_CONTEXT

GIB = 1 << 30


@pytest.fixture
def no_loading(monkeypatch):
    """LLM.load must fail in its checks: reading any weights fails the test."""
    def refuse(*args, **kw):
        raise AssertionError("weights were loaded before the sizes were checked")

    monkeypatch.setattr(loading_module, "load", refuse)


@pytest.mark.parametrize("kw, needle", [
    ({"k": 10**9}, "does not fit a context of 8192 tokens"),
    ({"k": 8191}, "at most 8190"),
    ({"k": 200, "max_seq_len": 128}, "does not fit a context of 128 tokens"),
    ({"max_seq_len": 10**9}, "exceeds the trained context"),
    ({"max_seq_len": 8193}, "8192 tokens"),
    ({"max_seq_len": 0}, "max_seq_len"),
    ({"max_seq_len": True}, "max_seq_len"),
    ({"max_seq_len": "512"}, "max_seq_len"),
    ({"k": -1}, "k (num_speculative_tokens)"),
    ({"k": 2.5}, "k (num_speculative_tokens)"),
])
def test_llm_load_rejects_sizes_before_loading(kw, needle, no_loading):
    real.path("smollm2-135m")
    with pytest.raises(ValueError) as e:
        LLM.load("smollm2-135m", backend="torch", drafter="ngram", **kw)
    assert needle in str(e.value)


def test_sizes_that_fit_pass_the_checks():
    path = real.path("smollm2-135m")
    for kw in ({"k": 8190}, {"max_seq_len": 8192, "k": 64},
               {"max_seq_len": MIN_CONTEXT, "k": MIN_CONTEXT - 2}):
        limits.check_load(str(path), dtype="float32", device="cpu", backend="torch",
                          **{"k": None, "max_seq_len": None, **kw})


def test_memory_estimate_refuses_what_does_not_fit(tmp_path, no_loading):
    """A model whose KV cache at its trained context would need ~4 TB: refused from
    config.json alone (this folder has no weights at all)."""
    raw = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
           "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "max_position_embeddings": 10**7}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"needs about \d+\.\d GB, but only .* available"):
        LLM.load(str(tmp_path), backend="torch", max_seq_len=8 * 10**6)


def test_memory_table(monkeypatch):
    """The estimate for the default target (1.5B) in bf16 is weights ~3.1 GB plus
    the KV cache: refused with 2 GiB available, accepted with 8 GiB."""
    cfg = PRESETS["qwen2.5-1.5b"]
    weights = limits.weight_bytes(cfg, 2)
    assert 3.0e9 < weights < 3.3e9
    assert limits.kv_cache_bytes(cfg, 8192, 2) == 2 * 28 * 2 * 128 * 8192 * 2
    monkeypatch.setattr(limits, "available_bytes", lambda: 2 * GIB)
    with pytest.raises(ValueError, match="max_seq_len"):
        limits.check_memory(weights, "the target")
    monkeypatch.setattr(limits, "available_bytes", lambda: 8 * GIB)
    limits.check_memory(weights + limits.kv_cache_bytes(cfg, 8192, 2), "the target")


def test_weight_estimate_counts_the_parameters():
    for name in ("tiny", "tiny-qwen2"):
        model = Transformer.random(PRESETS[name], seed=0)
        params = sum(p.numel() for p in model.parameters())  # tied weights counted once
        assert limits.weight_bytes(PRESETS[name], 4) == 4 * params


def test_transformer_checks_before_allocating():
    with pytest.raises(ValueError, match="exceeds the trained context"):
        Transformer(PRESETS["tiny"], max_seq_len=10**9)
    huge = PRESETS["tiny"].with_(max_position_embeddings=10**12)
    with pytest.raises(ValueError, match="KV cache of 1000000000000 tokens needs about"):
        Transformer(huge, max_seq_len=10**12)
    assert Transformer(PRESETS["tiny"], max_seq_len=512).k_cache[0].shape[1] == 512


def test_cost_measurement_stays_inside_the_context(tmp_path, monkeypatch):
    """The cost curve is measured for b <= the context left after its context (256
    tokens, or half a smaller one), however large k is (it once built k + 1 ids:
    10**9 of them)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    torch.manual_seed(0)
    cfg = PRESETS["tiny"].with_(vocab_size=2048)  # the measurement's ids go up to 1099
    model = Transformer.random(cfg, seed=1, max_seq_len=300)
    costs, cached = cached_costs(model, key="test", max_k=10**9, context_len=256)
    context = min(256, 300 // 2)  # a context under 512 measures after half of it
    assert not cached and max(costs.verify) <= 300 - context
    assert model.cached_len == 0


def test_llama_cpp_checks_its_context():
    from specdecode.models import llama_cpp

    if not llama_cpp.available():
        pytest.skip("llama-cpp-python is not installed")
    with pytest.raises(ValueError, match="exceeds the trained context"):
        llama_cpp.LlamaCppLM(real.path("smollm2-135m"), max_seq_len=10**9)
