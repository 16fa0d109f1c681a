"""The default pair (Qwen2.5-Coder 1.5B target + 0.5B draft) on real weights, float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import real
from specdecode import NgramDrafter, SamplingParams
from specdecode.llm import LLM, make_draft_model_drafter
from specdecode.models import loading

pytestmark = pytest.mark.slow

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Rewrite this loop as a list comprehension:\n\nresult = []\nfor x in range(10):\n"
    "    if x % 2 == 0:\n        result.append(x * x)\n",
]


@pytest.fixture(scope="module")
def pair():
    return real.load(TARGET), real.load(DRAFT)


@pytest.mark.parametrize("model, names", [
    (TARGET, ["token_embd.weight", "output.weight", "blk.0.attn_q.bias", "blk.0.ffn_down.weight"]),
    (DRAFT, ["token_embd.weight", "output.weight", "blk.0.ffn_down.weight",
             "blk.11.ffn_down.weight"]),
])
def test_dequantization_equals_gguf_reference(pair, model, names):
    """Q4_K, Q6_K, F32 (target) and Q5_0, Q8_0, Q6_K, Q4_K (draft) tensors."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    loaded = pair[0] if model == TARGET else pair[1]
    tensors = {t.name: t for t in GGUFReader(real.path(model)).tensors}
    state = loaded.model.state_dict()
    for name in names:
        t = tensors[name]
        ref = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        ref = torch.from_numpy(ref.reshape([int(d) for d in reversed(t.shape)]).copy())
        assert torch.equal(state[loading.gguf_name_to_ours(name)], ref), name


def test_types_covered(pair):
    from gguf import GGUFReader

    kinds = {t.tensor_type.name for m in (TARGET, DRAFT) for t in GGUFReader(real.path(m)).tensors}
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"} <= kinds


def test_qwen_chat_template(pair):
    tok = pair[0].tokenizer
    ids = tok.chat([{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"}])
    assert tok.hf.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                  "Hi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_ids == (151645,)


@pytest.fixture(scope="module")
def plain_outputs(pair):
    """Plain greedy decoding of each prompt, computed once for both drafters."""
    target = pair[0]
    llm = LLM(target.model, target.tokenizer, None, k=0)
    return [llm.generate(llm.encode(p, chat=True), SamplingParams(max_tokens=32)) for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_greedy_speculative_equals_plain(pair, plain_outputs, drafter):
    target, draft = pair
    proposer = (make_draft_model_drafter(draft.model, draft.tokenizer, target.model,
                                         target.tokenizer)
                if drafter == "draft-model" else NgramDrafter())
    llm = LLM(target.model, target.tokenizer, proposer, k=4)
    params = SamplingParams(max_tokens=32)
    accepted = 0
    for prompt, plain in zip(PROMPTS, plain_outputs):
        spec = llm.generate(llm.encode(prompt, chat=True), params)
        assert spec.token_ids == plain.token_ids, prompt
        assert spec.text == plain.text
        accepted += spec.stats.accepted
    assert accepted > 0
