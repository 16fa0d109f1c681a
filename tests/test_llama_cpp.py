"""The llama.cpp backend: the CausalLM contract, rollback, and lossless greedy decoding.

Needs the llama.cpp build (`specdecode build-llama-cpp`, which .ci/run runs):
skipped without it on a developer's machine, a failure in CI (CI=true), where
a skipped shipped backend would be an untested one.
Greedy speculative output is compared with plain decoding through the same
backend (llama.cpp's quantised weights, not the PyTorch model's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import real
from specdecode import NgramDrafter, SamplingParams, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter
from specdecode.models import llama_cpp  # noqa: E402
from specdecode.models.base import CausalLM

if not llama_cpp.available():  # (loads the cached llama.cpp build, if there is one)
    if os.environ.get("CI"):
        raise RuntimeError("CI must test the llama.cpp backend: run specdecode build-llama-cpp")
    pytest.skip("llama.cpp is not built (specdecode build-llama-cpp)", allow_module_level=True)
from specdecode.models.llama_cpp import LlamaCppLM  # noqa: E402

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "import numpy as np\n\nx = np.arange(10)\nprint(x",
]


@pytest.fixture(scope="module")
def smol() -> LlamaCppLM:
    return LlamaCppLM(real.path("smollm2-135m"), max_seq_len=512, n_threads=2)


@pytest.fixture(scope="module")
def smol_draft() -> LlamaCppLM:  # the file mapped, not read (the other way of loading)
    return LlamaCppLM(real.path("smollm2-135m"), max_seq_len=512, n_threads=2, mmap=True)


@pytest.fixture(scope="module")
def tokenizer():
    from specdecode.models.loading import load_tokenizer

    return load_tokenizer(real.path("smollm2-135m"))


def ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def greedy(target: CausalLM, prompt: list[int], n: int, drafter=None, k: int = 0, **kw):
    params = SamplingParams(max_tokens=n, **kw)
    return SpeculativeDecoder(target, drafter, k).generate(prompt, params)


def test_protocol_shapes_and_options(smol, tokenizer):
    assert isinstance(smol, CausalLM)
    assert smol.device == torch.device("cpu") and smol.dtype == torch.float32
    assert smol.max_seq_len == 512 and smol.eos_token_ids == tokenizer.eos_token_ids
    prompt = tokenizer.encode(PROMPTS[0])
    out = smol.prefill(ids(prompt))
    assert out.logits.shape == (1, smol.vocab_size) and out.logits.dtype == torch.float32
    assert smol.cached_len == len(prompt)
    out = smol.forward(ids([1, 2, 3]), last_n=2, return_hidden=True)
    assert out.logits.shape == (2, smol.vocab_size)
    assert out.hidden.shape == (2, smol.hidden_size)
    assert smol.cached_len == len(prompt) + 3
    with pytest.raises(NotImplementedError):
        smol.forward(ids([1]), positions=ids([0]))
    with pytest.raises(ValueError, match="context limit"):
        smol.forward(torch.zeros(512, dtype=torch.long))
    with pytest.raises(ValueError):
        smol.rollback(smol.cached_len + 1)


def test_rollback_forgets_the_rejected_positions(smol, tokenizer):
    prompt = tokenizer.encode(PROMPTS[2])
    head, tail = prompt[:10], prompt[10:16]
    smol.prefill(ids(head))
    first = smol.forward(ids(tail)).logits
    smol.forward(ids([5, 6, 7, 8]))  # a rejected draft
    smol.rollback(len(head))
    again = smol.forward(ids(tail)).logits
    assert torch.equal(first, again)  # same batch shapes: bit-identical
    # After rollback, logits match a fresh prefill of the same prefix.
    smol.rollback(len(head) + 3)
    after = smol.forward(ids(tail[3:])).logits
    fresh_prefix = smol.prefill(ids(head + tail[:3]))
    fresh = smol.forward(ids(tail[3:])).logits
    assert fresh_prefix.logits.shape == (1, smol.vocab_size)
    torch.testing.assert_close(after, fresh, atol=0.05, rtol=0)
    assert torch.equal(after.argmax(-1), fresh.argmax(-1))


def test_mapped_and_read_weights_give_the_same_logits(smol, smol_draft, tokenizer):
    assert not smol.mmap and smol_draft.mmap and "mmap=True" in repr(smol_draft)
    assert smol.huge_pages and smol.huge_page_bytes >= 0  # best effort: the kernel may say no
    prompt = ids(tokenizer.encode(PROMPTS[2]))
    assert torch.equal(smol.prefill(prompt).logits, smol_draft.prefill(prompt).logits)


def test_batched_logits_are_close_to_one_token_steps(smol, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1])
    smol.prefill(ids(prompt[:-4]))
    batched = smol.forward(ids(prompt[-4:])).logits  # [4, vocab]
    smol.rollback(len(prompt) - 4)
    single = torch.cat([smol.forward(ids([t])).logits for t in prompt[-4:]])
    torch.testing.assert_close(batched, single, atol=0.05, rtol=0)
    assert torch.equal(batched.argmax(-1), single.argmax(-1))


def test_hidden_state_is_the_final_normed_state(smol, tokenizer):
    """llama.cpp's hidden state projected by the PyTorch model's head gives its logits."""
    torch_model = real.load("smollm2-135m").model  # float32, same GGUF dequantized
    prompt = tokenizer.encode(PROMPTS[0])
    out = smol.prefill(ids(prompt))
    smol.rollback(len(prompt) - 1)
    out = smol.forward(ids(prompt[-1:]), return_hidden=True)
    projected = torch_model.lm_head(out.hidden).detach()
    assert torch.nn.functional.cosine_similarity(projected, out.logits).item() > 0.99


def test_asking_for_hidden_states_leaves_the_logits_as_they_are(smol, tokenizer):
    """With hidden states on, llama.cpp outputs every position: the logits read must
    still be the last_n wanted ones, in that call and in later calls without them."""
    prompt = ids(tokenizer.encode(PROMPTS[1]))
    plain = smol.prefill(prompt[:-3]).logits  # [1, vocab]
    tail = smol.forward(prompt[-3:]).logits  # [3, vocab]
    smol.rollback(0)
    both = smol.forward(prompt[:-3], last_n=1, return_hidden=True)
    assert torch.equal(both.logits, plain) and both.hidden.shape == (1, smol.hidden_size)
    assert torch.equal(smol.forward(prompt[-3:], last_n=2).logits, tail[1:])
    assert torch.equal(smol.prefill(prompt[:-3]).logits, plain)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_draft_model_equals_plain(smol, smol_draft, tokenizer, k):
    drafter = DraftModelDrafter(smol_draft, smol)
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        plain = greedy(smol, prompt, 32, ignore_eos=True)
        spec = greedy(smol, prompt, 32, drafter, k, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, (text, k)
        assert spec.stats.acceptance_rate > 0.9  # the target drafting for itself


@pytest.mark.parametrize("k", [2, 8])
def test_greedy_ngram_equals_plain(smol, tokenizer, k):
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        plain = greedy(smol, prompt, 32, ignore_eos=True)
        spec = greedy(smol, prompt, 32, NgramDrafter(max_n=3, min_n=1), k, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, (text, k)


def test_seeded_sample_with_ngram_drafts_equals_plain(smol, tokenizer):
    """At T > 0 n-gram speculation emits the seeded plain sample itself (only
    near-ties of batched vs one-token logits could differ, as in greedy)."""
    params = SamplingParams(temperature=0.7, max_tokens=32, ignore_eos=True)
    prompt = tokenizer.encode(PROMPTS[0])
    for seed in range(3):
        plain = SpeculativeDecoder(smol, None).generate(prompt, params, seed=seed)
        spec = SpeculativeDecoder(smol, NgramDrafter(max_n=3), 4).generate(prompt, params,
                                                                            seed=seed)
        assert spec.token_ids == plain.token_ids, seed


def test_stops_inside_a_draft(smol, smol_draft, tokenizer):
    prompt = tokenizer.chat([{"role": "user", "content": "Say only: hello"}])
    drafter = DraftModelDrafter(smol_draft, smol)
    plain = greedy(smol, prompt, 64)
    assert plain.finish_reason == "stop" and plain.token_ids[-1] in smol.eos_token_ids
    spec = greedy(smol, prompt, 64, drafter, 8)  # EOS arrives inside a draft
    assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, "stop")
    assert spec.stats.steps < len(plain.token_ids)  # more than one token per step
    prompt = tokenizer.encode(PROMPTS[0])
    full = greedy(smol, prompt, 16, ignore_eos=True).token_ids
    for n in (1, 5, 13):  # max_tokens in the middle of an accepted draft
        cut = greedy(smol, prompt, n, drafter, 8, ignore_eos=True)
        assert (cut.token_ids, cut.finish_reason) == (full[:n], "length")


def test_cached_ids_follow_the_cache():
    from test_prefix_cache import check_cached_ids

    check_cached_ids(LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2))


def test_turns_reuse_the_cache(smol, tokenizer):
    """Three agent-like turns (each prompt = the last prompt + its answer + new text), the
    prefix cache on and off. Reused keys/values of the answer come from one-token steps
    and verification batches, a fresh prefill's from one prompt batch: llama.cpp rounds
    those apart in the last bits (README "Exactness"); measured identical here (SmolLM2
    Q4_1, these prompts), so asserted identical, with the reuse itself counted."""
    from test_prefix_cache import turns

    prompt = tokenizer.encode(PROMPTS[0])
    extra = [tokenizer.encode("\n\n# Now without recursion:\n"),
             tokenizer.encode("\n\n# With type hints:\n")]

    def decoder(prefix_cache):
        return lambda t: SpeculativeDecoder(t, NgramDrafter(), 6, prefix_cache=prefix_cache)

    reused = turns(smol, decoder(True), prompt, extra, 32)
    fresh = turns(smol, decoder(False), prompt, extra, 32)
    assert [ids for ids, _ in reused] == [ids for ids, _ in fresh]
    assert [c for _, c in fresh] == [0, 0, 0]
    assert reused[1][1] == len(prompt) + 32 - 1


def test_snapshot_restores_the_cache(smol):
    """llama_state_seq_get/set_data: the restored cells score the next tokens exactly."""
    from test_prefix_store import check_snapshot_restores_the_cache

    check_snapshot_restores_the_cache(smol)


def test_users_taking_turns_resume_their_own_cache(smol):
    """Two conversations interleaved with the prefix store: each turn 2 reuses its whole
    turn 1 (the store restores it), without the store only the shared start; the
    tokens are the same either way (measured identical here, SmolLM2 Q4_1)."""
    from test_prefix_store import A, check_users_taking_turns

    stored = check_users_taking_turns(smol)
    plain = check_users_taking_turns(smol, store_mb=0)
    assert [ids for ids, _ in stored] == [ids for ids, _ in plain]
    assert [c for _, c in stored] == [0, 4, len(A) + 11, len(A) + 11]
    assert [c for _, c in plain] == [0, 4, 4, 4]


def test_llm_load_chooses_the_backend(tmp_path):
    from specdecode.llm import LLM, choose_backend

    path = real.path("smollm2-135m")
    assert choose_backend("auto", path, "cpu") == "llama.cpp"  # GGUF on CPU
    assert choose_backend("llama.cpp", path, "cpu") == "llama.cpp"
    assert choose_backend("auto", path, "cuda") == "torch"
    assert choose_backend("auto", tmp_path, "cpu") == "torch"
    with pytest.raises(ValueError, match="GGUF"):
        choose_backend("llama.cpp", tmp_path, "cpu")
    llm = LLM.load("smollm2-135m", drafter="ngram", k=4, backend="llama.cpp", max_seq_len=256,
                   adaptive=False)
    assert isinstance(llm.target, LlamaCppLM) and llm.info.backend == "llama.cpp"
    assert llm.decoder.controller is None
    prompt = llm.encode("Count from 1 to 10.", chat=True)
    params = SamplingParams(max_tokens=24)
    spec = llm.generate(prompt, params)
    assert spec.token_ids == llm.generate(prompt, params, speculative=False).token_ids
    assert spec.text


def test_cli_backend_flag():
    real.path("smollm2-135m")
    proc = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "generate", "def add(a, b):", "--target",
         "smollm2-135m", "--drafter", "ngram", "--max-tokens", "16", "--backend", "llama.cpp",
         "--compare-plain", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backend"] == "llama.cpp" and out["identical_to_plain"] is True
    assert proc.stderr == ""  # llama.cpp's own log is silenced


def test_adaptive_load_measures_costs_once_and_says_what_it_chose(tmp_path, monkeypatch):
    from specdecode.llm import LLM

    monkeypatch.setattr("specdecode.costs.costs_dir", lambda: tmp_path)  # a fresh cache
    # The caching itself is tested here; whether a measurement is clean enough to be
    # cached (monotone, a quiet machine) is tests/test_controller.py's: SmolLM2's
    # millisecond passes are too noisy for that check to pass every time.
    monkeypatch.setattr("specdecode.costs.disturbed_points", lambda curve: set())
    monkeypatch.setattr("specdecode.costs.others_busy", lambda before: 0.0)
    monkeypatch.setattr("specdecode.costs.DRIFT_SLACK", float("inf"))
    path = str(real.path("smollm2-135m"))
    first = LLM.load(path, draft_model=path, drafter="auto", backend="llama.cpp",
                     max_seq_len=512)
    costs = first.info.costs
    assert costs["c"][1] == 1.0 and set(range(1, 10)) <= set(costs["c"])
    assert costs["c_draft"] > 0 and costs["from_cache"] is False
    assert first.info.drafter in ("ngram+suffix+draft-model", "ngram+suffix")
    assert "n-gram and suffix lookup" in first.info.choice and "draft length" in first.info.choice
    assert first.decoder.controller is not None
    again = LLM.load(path, draft_model=path, drafter="auto", backend="llama.cpp",
                     max_seq_len=512)
    assert again.info.costs == {**costs, "from_cache": True}
    curves = [f for f in tmp_path.iterdir() if not f.name.startswith("prefill-copy-")]
    assert len(curves) == 1  # (beside it: llama_cpp_prefill's decision, one per GGUF)
    # Lossless whatever the policy cuts: greedy output equals plain decoding.
    ngram = LLM.load(path, drafter="ngram", backend="llama.cpp", max_seq_len=512)
    assert ngram.info.costs["c_draft"] == 0.0 and ngram.decoder.controller is not None
    for text in PROMPTS:
        prompt = ngram.tokenizer.encode(text)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        spec = ngram.generate(prompt, params)
        assert spec.token_ids == ngram.generate(prompt, params, speculative=False).token_ids


@pytest.mark.slow
def test_default_pair_greedy_equals_plain():
    from specdecode.llm import LLM

    llm = LLM.load("default", drafter="draft-model", k=4, backend="llama.cpp", max_seq_len=1024,
                   adaptive=False)
    assert isinstance(llm.target, LlamaCppLM) and isinstance(llm.drafter.model, LlamaCppLM)
    prompt = llm.encode("Write a Python function that reverses a string.", chat=True)
    params = SamplingParams(max_tokens=48)
    spec = llm.generate(prompt, params)
    plain = llm.generate(prompt, params, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.acceptance_rate > 0.3
