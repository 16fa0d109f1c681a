"""HF transformers as a peer: plain decoding, assisted generation, prompt lookup.

Same weights (transformers dequantizes a GGUF itself, or reads the HF
folder), same prompt ids, timed end to end (prefill included) like
specdecode's runs. Sampling uses temperature only (top-k and top-p off), as
specdecode's bench does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PeerRun:
    token_ids: list[int]
    finish_reason: str
    seconds: float


def available() -> bool:
    try:
        import accelerate  # noqa: F401  (transformers needs it for GGUF)
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def load(path: Path, dtype: str | torch.dtype = torch.bfloat16):
    """AutoModelForCausalLM from a GGUF file or an HF folder, in `dtype`, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from specdecode.models.loading import parse_dtype

    logging.set_verbosity_error()
    path = Path(path)
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=parse_dtype(dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(dtype))
    return model.eval()


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Peer:
    """The HF target (and assistant) behind the bench's peer configurations."""

    def __init__(self, target, draft=None, eos_token_ids: tuple[int, ...] = ()) -> None:
        """eos_token_ids: the stop ids specdecode uses for the same model (default: the
        model's generation config)."""
        self.target, self.draft = target, draft
        eos = eos_token_ids or target.generation_config.eos_token_id
        self.eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.target_bytes = _bytes(target)
        self.draft_bytes = _bytes(draft) if draft is not None else 0

    @classmethod
    def load(cls, target_path: Path, draft_path: Path | None, dtype: str,
             eos_token_ids: tuple[int, ...] = ()) -> Peer:
        return cls(load(target_path, dtype), load(draft_path, dtype) if draft_path else None,
                   eos_token_ids)

    def generate(self, prompt_ids: list[int], method: str, max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0, prompt_lookup: int = 10) -> PeerRun:
        """method: plain | assisted | prompt-lookup."""
        return generate(self.target, prompt_ids, max_new_tokens, self.eos,
                        assistant=self.draft if method == "assisted" else None,
                        prompt_lookup=prompt_lookup if method == "prompt-lookup" else 0,
                        temperature=temperature, seed=seed)


def generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | list[int],
             assistant=None, prompt_lookup: int = 0, temperature: float = 0.0,
             seed: int = 0) -> PeerRun:
    ids = torch.tensor([prompt_ids])
    eos = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                  attention_mask=torch.ones_like(ids))
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    new = out[0, len(prompt_ids):].tolist()
    finish = "stop" if new and new[-1] in eos else "length"
    return PeerRun(new, finish, seconds)
