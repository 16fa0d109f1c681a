"""HF transformers as a peer: plain, assisted generation, prompt lookup.

Same GGUF weights (transformers dequantizes them itself), same prompt ids,
greedy, timed end to end (prefill included) like specdecode's runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PeerRun:
    token_ids: list[int]
    seconds: float


def available() -> bool:
    try:
        import accelerate  # noqa: F401  (transformers needs it for GGUF)
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def load_gguf(path: Path, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype)
    return model.eval()


def generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None,
             assistant=None, prompt_lookup: int = 0) -> PeerRun:
    ids = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                  pad_token_id=eos_token_id, attention_mask=torch.ones_like(ids))
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    return PeerRun(out[0, len(prompt_ids):].tolist(), seconds)
