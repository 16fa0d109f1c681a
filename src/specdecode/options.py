"""Load options: what a user asks `LLM.load` for, validated, and errors that name them.

`LoadSpec` is the frozen, validated set of options (the keyword arguments of
`LLM.load`, one field each). Each field is checked on its own when the spec is
made; combinations (a drafter that needs a draft model, a backend that cannot
run a file) are checked when the spec is resolved into a plan (plan.py).

`OptionError` is the ValueError every such check raises. Its message names the
options by their Python API names ("max_seq_len", "draft_model"); a front end
renders the same message with its own names (the CLI: its flags, one table in
cli.py) through `OptionError.render`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

DRAFTERS = ("auto", "draft-model", "ngram", "suffix", "hidden-head", "eagle3", "none")
BACKENDS = ("auto", "torch", "llama.cpp")
DRAFT_QUANTS = ("auto", "int8", "none")
DTYPES = ("bfloat16", "float32", "float16", "bf16", "fp32", "fp16")

MIN_CONTEXT = 16  # the smallest max_seq_len a load takes (its cost curve measures in it)

# How a message names an option when no front end renames it (the API's own names).
API_NAMES = {"k": "k (num_speculative_tokens)"}
_MARK = re.compile(r"<(\w+)>")


class OptionError(ValueError):
    """A bad load option (or combination). `message` marks each option it names as
    `<name>` (the LoadSpec field); str(error) is the message in API terms and
    `render(names)` the message with a front end's names for the options.
    `param` is the first option named (None: the message names none)."""

    def __init__(self, message: str) -> None:
        self.message = message
        names = [m for m in _MARK.findall(message) if m in SPEC_FIELDS]
        self.param = names[0] if names else None
        super().__init__(self.render({}))

    def render(self, names: Mapping[str, str]) -> str:
        """The message with each marked option named names[option] (default: its API
        name); markers that are not option names are left as they are."""
        def name(m: re.Match) -> str:
            field = m.group(1)
            if field not in SPEC_FIELDS:
                return m.group(0)
            return names.get(field, API_NAMES.get(field, field))
        return _MARK.sub(name, self.message)


def _int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _dtype_name(dtype: object) -> str:
    """"bfloat16" for "bfloat16" and for torch.bfloat16 (whose str is "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LoadSpec:
    """What to load and how to decode, as asked (None: the default, decided when the
    spec is resolved: see plan.resolve). Every field is validated here, alone:
    a bad value raises OptionError naming the field.

    target / draft_model: registry name or path (draft_model None: the pair's draft
    when the target is a registry pair). drafter: auto | draft-model | ngram | suffix |
    hidden-head | eagle3 | none (suffix: drafters/suffix.py, with a store of earlier
    requests; eagle3: drafters/eagle.py, torch backend).
    k: draft tokens per step (0: plain decoding). backend: auto | torch | llama.cpp
    (None: $SPECDECODE_BACKEND, else auto). dtype, device: the torch backend's.
    max_seq_len: KV cache size in tokens (at least MIN_CONTEXT). ngram_max /
    ngram_min: n-gram lengths looked up. draft_quant: auto | int8 | none.
    draft_confidence: in [0, 1].
    adaptive: the closed-loop engine (None: from the target's cost curve).
    head: a trained head's folder (drafter hidden-head: drafters/hidden_head.py;
    eagle3: drafters/eagle.py, ours or in the speculators format; trained by
    specdecode.train)."""

    target: str | os.PathLike = "default"
    draft_model: str | os.PathLike | None = None
    drafter: str | None = None
    k: int | None = None
    backend: str | None = None
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_seq_len: int | None = None
    ngram_max: int | None = None
    ngram_min: int = 1
    draft_quant: str = "auto"
    draft_confidence: float = 0.3
    adaptive: bool | None = None
    head: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_numbers(self)


def _check_choices(s: LoadSpec) -> None:
    if s.drafter is not None and s.drafter not in DRAFTERS:
        raise OptionError(f"unknown <drafter> '{s.drafter}'; choose one of {', '.join(DRAFTERS)}")
    if s.backend is not None and s.backend not in BACKENDS:
        raise OptionError(f"unknown <backend> '{s.backend}'; choose one of {', '.join(BACKENDS)}")
    if s.draft_quant not in DRAFT_QUANTS:
        raise OptionError(f"unknown <draft_quant> '{s.draft_quant}'; choose one of "
                          f"{', '.join(DRAFT_QUANTS)}")
    if _dtype_name(s.dtype) not in DTYPES:
        raise OptionError(f"unknown <dtype> '{s.dtype}'; choose one of float32, bfloat16, "
                          "float16")
    if s.head is not None and not (Path(s.head) / "config.json").is_file():
        raise OptionError(f"<head> {s.head}: no trained head there (a folder with "
                          "config.json and model.safetensors, as HiddenStateHead.save writes)")
    if s.adaptive is not None and not isinstance(s.adaptive, bool):
        raise OptionError(f"<adaptive> must be True, False or None, got {s.adaptive!r}")


def _check_numbers(s: LoadSpec) -> None:
    if s.k is not None and not _int_at_least(s.k, 0):
        raise OptionError(f"<k> must be an integer >= 0, got {s.k!r}")
    if s.max_seq_len is not None and not _int_at_least(s.max_seq_len, 1):
        raise OptionError(f"<max_seq_len> must be an integer >= 1, got {s.max_seq_len!r}")
    if s.max_seq_len is not None and s.max_seq_len < MIN_CONTEXT:
        raise OptionError(f"<max_seq_len> must be at least {MIN_CONTEXT} tokens (a prompt, "
                          f"the answer and a draft), got {s.max_seq_len}")
    if s.ngram_max is not None and not _int_at_least(s.ngram_max, 1):
        raise OptionError(f"<ngram_max> must be an integer >= 1, got {s.ngram_max!r}")
    if not _int_at_least(s.ngram_min, 1):
        raise OptionError(f"<ngram_min> must be an integer >= 1, got {s.ngram_min!r}")
    c = s.draft_confidence
    if isinstance(c, bool) or not isinstance(c, int | float) or not 0.0 <= c <= 1.0:
        raise OptionError(f"<draft_confidence> must be a number in [0, 1], got {c!r}")


def check_device(device: object) -> None:
    """A device this torch can use (OptionError naming <device> otherwise), checked
    before any model is loaded."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise OptionError(f"<device>: unknown device '{device}' (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"<device> {device}: this torch has no CUDA device "
                              f"(torch {torch.__version__}); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OptionError(f"<device> {device}: only {torch.cuda.device_count()} CUDA "
                              "device(s) here")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise OptionError(f"<device> {device}: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise OptionError(f"<device> {device}: not supported (cpu, cuda, cuda:N)")


SPEC_FIELDS = frozenset(f.name for f in fields(LoadSpec))
