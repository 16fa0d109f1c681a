"""The native transformer: cache rollback, batched vs one-token passes, options."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny
from specdecode.models import PRESETS, CausalLM, ModelConfig

IDS = torch.tensor([5, 9, 200, 31, 7, 77, 3, 150, 42, 8])


def test_is_a_causal_lm():
    assert isinstance(tiny(1), CausalLM)


def test_same_seed_same_weights():
    a, b = tiny(3), tiny(3)
    assert torch.equal(a.prefill(IDS).logits, b.prefill(IDS).logits)
    assert not torch.equal(a.prefill(IDS).logits, tiny(4).prefill(IDS).logits)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])
def test_rollback_then_forward_equals_fresh_prefill(preset):
    model = tiny(1, preset)
    model.prefill(IDS)
    assert model.cached_len == len(IDS)
    model.rollback(6)
    other = torch.tensor([1, 2, 3])
    got = model.forward(other).logits  # [3, vocab]
    fresh = tiny(1, preset)
    want = fresh.forward(torch.cat((IDS[:6], other))).logits[-3:]
    assert model.cached_len == 9
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batched_pass_matches_one_token_passes():
    model = tiny(2)
    model.prefill(IDS[:1])
    batched = model.forward(IDS[1:]).logits  # [9, vocab]
    model.rollback(1)
    single = torch.cat([model.forward(IDS[i : i + 1]).logits for i in range(1, len(IDS))])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert torch.equal(batched.argmax(-1), single.argmax(-1))


def test_last_n_and_hidden_states():
    model = tiny(1)
    out = model.forward(IDS, last_n=2, return_hidden=True)
    assert out.logits.shape == (2, model.vocab_size) and out.logits.dtype == torch.float32
    assert out.hidden.shape == (2, model.config.hidden_size)
    full = tiny(1).forward(IDS).logits
    torch.testing.assert_close(out.logits, full[-2:])


def test_tree_mask_and_positions_match_chain():
    """Two sibling branches verified in one pass equal each branch run as a chain."""
    model = tiny(1)
    prefix, a, b = IDS[:5], torch.tensor([11, 12]), torch.tensor([21])
    model.prefill(prefix)
    # nodes: a0 (depth 0), a1 (depth 1, child of a0), b0 (depth 0)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    positions = torch.tensor([5, 6, 5])
    got = model.forward(torch.cat((a, b)), positions=positions, tree_mask=tree).logits
    chain_a = tiny(1).forward(torch.cat((prefix, a))).logits[-2:]
    chain_b = tiny(1).forward(torch.cat((prefix, b))).logits[-1:]
    torch.testing.assert_close(got, torch.cat((chain_a, chain_b)), atol=1e-5, rtol=1e-5)


def test_context_limit_is_an_error_not_an_overflow():
    model = tiny(1, max_seq_len=8)
    with pytest.raises(ValueError, match="context limit of 8"):
        model.forward(IDS)
    with pytest.raises(ValueError, match="cannot roll back"):
        model.rollback(3)


def test_bfloat16_runs_and_mostly_agrees_with_float32():
    f32 = tiny(1)
    bf16 = tiny(1, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.k_cache[0].dtype == torch.bfloat16
    a, b = f32.prefill(IDS).logits, bf16.prefill(IDS).logits
    assert b.dtype == torch.float32
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_tied_embeddings_share_storage():
    model = tiny(1, "tiny-qwen2")
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].self_attn.q_proj.bias is not None


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PRESETS["tiny"].with_(num_kv_heads=3)
    assert ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1,
                       num_heads=4, num_kv_heads=4).head_dim == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_forward_matches_cpu():
    cpu, gpu = tiny(1), tiny(1, device="cuda")
    torch.testing.assert_close(gpu.prefill(IDS).logits.cpu(), cpu.prefill(IDS).logits,
                               atol=1e-3, rtol=1e-3)

