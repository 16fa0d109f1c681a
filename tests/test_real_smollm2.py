"""Real weights, tokenizer and chat template on SmolLM2-135M (llama architecture)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import real
from specdecode import NgramDrafter, SamplingParams
from specdecode.drafters import DraftModelDrafter
from specdecode.llm import LLM
from specdecode.models import Transformer, loading
from specdecode.text import StopStrings, TextStream


@pytest.fixture(scope="module")
def smol():
    return real.load("smollm2-135m")


def test_config_from_gguf_metadata(smol):
    cfg = smol.model.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama", 30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and not cfg.qkv_bias
    assert cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)


def test_weights_equal_gguf_reference_dequantization(smol):
    """Q8_0, Q4_1 and F32 tensors equal gguf.quants.dequantize (llama q/k un-permuted)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(real.path("smollm2-135m"))
    tensors = {t.name: t for t in reader.tensors}
    state = smol.model.state_dict()
    kinds = set()
    for name in ["token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_v.weight",
                 "blk.0.attn_norm.weight", "blk.2.attn_q.weight", "blk.2.attn_k.weight"]:
        t = tensors[name]
        kinds.add(t.tensor_type.name)
        ref = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        ref = torch.from_numpy(ref.reshape([int(d) for d in reversed(t.shape)]).copy())
        ours = state[loading.gguf_name_to_ours(name)]
        if "attn_q" in name or "attn_k" in name:
            heads = 9 if "attn_q" in name else 3
            # llama.cpp's permutation applied to our rows gives the GGUF rows back
            d = ours.shape[0] // heads
            ours = ours.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(ours.shape)
        assert torch.equal(ours, ref), name
    assert {"Q8_0", "Q4_1", "F32"} <= kinds


def test_logits_match_hf_transformers_gguf_load(smol):
    """Our native model and transformers' own GGUF loader agree (float32)."""
    from transformers import AutoModelForCausalLM

    p = real.path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                              dtype=torch.float32)
    ids = smol.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = smol.model.prefill(torch.tensor(ids[:1])).logits  # warm the cache path too
    got = torch.cat((got, smol.model.forward(torch.tensor(ids[1:])).logits))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_hf_safetensors_folder_round_trip(smol, tmp_path):
    """Save as an HF folder (sharded, 'model.' prefix, tokenizer) and load it back."""
    cfg = smol.model.config
    state = {f"model.{k}": v.contiguous() for k, v in smol.model.state_dict().items()
             if k != "lm_head.weight"}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": True, "max_position_embeddings": 2048, "eos_token_id": 2,
        "bos_token_id": 1}))
    smol.tokenizer.save(tmp_path)

    loaded = loading.load(tmp_path, dtype="float32", max_seq_len=256)
    ids = torch.tensor(smol.tokenizer.encode("def add(a, b):"))
    torch.testing.assert_close(loaded.model.prefill(ids).logits, smol.model.prefill(ids).logits)
    assert loaded.tokenizer.encode("hello world") == smol.tokenizer.encode("hello world")

    from transformers import AutoModelForCausalLM  # the folder is a real HF checkpoint too

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        want = hf(ids[None]).logits[0, -1:]
    torch.testing.assert_close(loaded.model.prefill(ids).logits, want, atol=2e-3, rtol=2e-3)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(loading.UnsupportedModel, match="unsupported architecture 'gpt_neox'"):
        loading.load(tmp_path)


def test_tokenizer_and_chat_template(smol):
    tok = smol.tokenizer
    text = "def add(a, b):\n    return a + b"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.chat([{"role": "user", "content": "Hi!"}])
    rendered = tok.hf.decode(ids)
    assert "<|im_start|>user\nHi!<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_ids == (2,)
    with pytest.raises(ValueError, match="a string 'role' and a 'content'"):
        tok.chat([{"content": "no role"}])


def _pick_stop(llm, prompt_ids, params):
    """A stop string from the middle of the plain output that spans several tokens."""
    plain = llm.generate(prompt_ids, params, speculative=False)
    tok = llm.tokenizer
    for start in range(8, len(plain.token_ids) - 4):
        piece = tok.decode(plain.token_ids[start : start + 3])
        if len(piece.strip()) >= 4 and tok.decode(plain.token_ids).count(piece) == 1:
            # cut the piece so it starts and ends inside tokens
            return piece[1:-1], plain
    raise AssertionError("no stop string candidate")


def test_stop_string_spanning_tokens_inside_a_draft(smol):
    tok = smol.tokenizer
    # A draft model sharing the vocabulary: SmolLM2's shape with one random layer.
    random_draft = Transformer.random(smol.model.config.with_(num_layers=1), seed=0,
                                      max_seq_len=256)
    for drafter in (NgramDrafter(), DraftModelDrafter(random_draft, smol.model)):
        llm = LLM(smol.model, tok, drafter, k=6)
        prompt_ids = tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.")
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        stop, plain = _pick_stop(llm, prompt_ids, params)
        params = SamplingParams(max_tokens=60, ignore_eos=True, stop=(stop,))
        spec = llm.generate(prompt_ids, params)
        want = llm.generate(prompt_ids, params, speculative=False)
        assert spec.token_ids == want.token_ids and spec.text == want.text
        assert spec.finish_reason == want.finish_reason == "stop"
        full = tok.decode(plain.token_ids)
        assert spec.text == full[: full.index(stop)]
        assert stop in tok.decode(spec.token_ids) and stop not in tok.decode(spec.token_ids[:-1])
        assert spec.completion_tokens == len(spec.token_ids) < 60


def test_text_stream_holds_back_partial_stops(smol):
    tok = smol.tokenizer
    ids = tok.encode("alpha beta gamma delta")
    stream = TextStream(tok, stops=("gamma",))
    out = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert out == "alpha beta "
    assert StopStrings(tok, ("gamma",))(ids) and not StopStrings(tok, ("omega",))(ids)


def test_llm_greedy_ngram_matches_plain(smol):
    llm = LLM(smol.model, smol.tokenizer, NgramDrafter(), k=5)
    ids = llm.encode("Repeat after me: the quick brown fox jumps over the lazy dog. "
                     "the quick brown fox", chat=True)
    params = SamplingParams(max_tokens=48)
    spec, plain = llm.generate(ids, params), llm.generate(ids, params, speculative=False)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stats.steps < plain.stats.steps
