"""LLM: a target, a drafter and a tokenizer behind one text-level API.

This is what the CLI and the server use: load models by registry name or
path, turn prompts or chat messages into ids, generate or stream text with
stop strings, and run plain decoding of the same request for comparison.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.controller import Controller, Slot
from specdecode.drafters import DraftModelDrafter, NgramDrafter, VocabularyMismatch
from specdecode.drafters.base import Drafter
from specdecode.engine import SpeculativeDecoder
from specdecode.models.base import CausalLM
from specdecode.models.loading import Loaded
from specdecode.models.quant import quantize_int8, worth_it
from specdecode.sampling import SamplingParams
from specdecode.speclen import CostModel, LengthPolicy, best_length
from specdecode.stats import SpecStats
from specdecode.text import TextStream, Tokenizer

DRAFTERS = ("auto", "draft-model", "ngram", "none")
BACKENDS = ("auto", "torch", "llama.cpp")


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats
    prompt_tokens: int
    seconds: float  # wall time of the whole call, prefill included

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class TextChunk:
    text: str  # new text, safe to show
    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats


@dataclass
class LoadInfo:
    target: str
    draft: str | None = None
    drafter: str = "none"
    backend: str = "torch"
    choice: str | None = None  # why this drafter / length policy, when chosen from costs
    costs: dict | None = None  # c(b) in plain steps, c_draft, where they came from
    seconds: dict[str, float] = field(default_factory=dict)
    from_cache: dict[str, bool] = field(default_factory=dict)


class LLM:
    def __init__(
        self,
        target: CausalLM,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        k: int = 4,
        info: LoadInfo | None = None,
        controller: Controller | None = None,
    ) -> None:
        """drafter: one drafter used at every step, or None; controller: the drafters
        and their per-step choice from observed costs (controller.py) instead."""
        eos = tuple(dict.fromkeys((*target.eos_token_ids, *tokenizer.eos_token_ids)))
        self.target, self.tokenizer = target, tokenizer
        self.decoder = SpeculativeDecoder(target, drafter, k, eos_token_ids=eos,
                                          controller=controller)
        self.plain = SpeculativeDecoder(target, None, 0, eos_token_ids=eos)
        drafters = self.decoder.drafters
        # The draft model's drafter when there is one (bench, advise read its model).
        self.drafter = next((d for d in drafters if hasattr(d, "model")),
                            drafters[0] if drafters else None)
        self.info = info or LoadInfo(target="?")

    @property
    def k(self) -> int:
        return self.decoder.k

    @property
    def speculative(self) -> bool:
        """Whether generation drafts at all (a drafter and k > 0)."""
        return bool(self.decoder.drafters) and self.k > 0

    @classmethod
    def load(
        cls,
        target: str = "default",
        *,
        draft_model: str | None = None,
        drafter: str | None = None,
        k: int | None = None,
        dtype: str = "bfloat16",
        device: str = "cpu",
        max_seq_len: int | None = None,
        ngram_max: int | None = None,
        ngram_min: int = 1,
        draft_quant: str = "auto",
        draft_confidence: float = 0.3,
        backend: str | None = None,
        adaptive: bool | None = None,
    ) -> LLM:
        """Load by registry name or path. `drafter` defaults to draft-model when a
        draft model is given (or the target is a registry pair; "auto" on the
        llama.cpp backend), else none. k defaults to 8 for a draft model and 16
        for n-gram lookup (its drafts cost nothing, and copied text runs long; 64
        when adaptive). ngram_max defaults to 3 (8 when adaptive).

        adaptive: choose each step's drafter and draft length from costs and
        acceptance observed as the engine runs (controller.py), the target's cost
        curve measured at load (cached per model and machine when the measurement
        was clean) being only the prior; None: on for the llama.cpp backend, whose
        small verification batches cost almost a plain step per token. drafter
        "auto" (adaptive only): n-gram lookup, plus the draft model when its
        start-up costs predict 1.1x or more at 90 % acceptance; every step uses
        whichever pays most on observed costs, or none (a plain step), and a draft
        model that does not pay is paused. `info.choice` says what was chosen.

        draft_quant: "int8" (weight-only, half the bytes per draft token),
        "none", or "auto" (int8 on CPU in bf16/fp16). It changes only the acceptance rate,
        never the output. draft_confidence: stop a draft after a token the draft
        model gave less than this probability (0 = always draft k).

        backend: "torch" (the native PyTorch model: any device, `dtype` applies),
        "llama.cpp" (GGUF files on CPU through llama-cpp-python, the GGUF's own
        quantised weights; `dtype` and `draft_quant` do not apply), or "auto"
        (llama.cpp for GGUF files on CPU when llama-cpp-python is installed, else
        torch; see `choose_backend`). None: $SPECDECODE_BACKEND, else "auto".
        Chosen per model."""
        from specdecode import limits
        from specdecode.models import registry

        limits.check_load(target, k=k, max_seq_len=max_seq_len, dtype=dtype, device=device,
                          backend=backend)
        if drafter is not None and drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter '{drafter}'; choose one of {', '.join(DRAFTERS)}")
        if draft_model is None and target in registry.PAIRS and drafter in (
                None, "draft-model", "auto"):
            draft_model = registry.PAIRS[target][1]
        if backend is None:
            backend = os.environ.get("SPECDECODE_BACKEND") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
        target_path = registry.resolve(target)
        target_backend = choose_backend(backend, target_path, device)
        if adaptive is None:
            adaptive = target_backend == "llama.cpp"
        if drafter is None:
            drafter = ("auto" if adaptive else "draft-model") if draft_model else "none"
        if drafter == "auto" and not adaptive:
            raise ValueError("--drafter auto chooses from measured costs: it needs --adaptive")
        if k is None:  # a cap when adaptive: long copies pay off even at c(65) ~ 10 steps
            k = (64 if adaptive else 16) if drafter in ("ngram", "auto") else 8
        if ngram_max is None:  # the policy needs precise matches more than many matches
            ngram_max = 8 if adaptive else 3
        if drafter == "draft-model" and not draft_model:
            raise ValueError("--drafter draft-model needs --draft-model")
        if draft_quant not in ("auto", "int8", "none"):
            raise ValueError(f"unknown draft quantisation '{draft_quant}'; choose auto, int8, none")
        if draft_quant == "auto":
            draft_quant = "int8" if worth_it(device, dtype) else "none"
        draft_path = (registry.resolve(draft_model) if drafter == "draft-model" or (
            drafter == "auto" and draft_model) else None)
        info = LoadInfo(target=str(target_path), drafter=drafter, backend=target_backend)
        t = load_model(target_path, target_backend, dtype=dtype, device=device,
                       max_seq_len=max_seq_len)
        info.seconds["target"], info.from_cache["target"] = t.load_seconds, t.from_cache
        proposer: Drafter | None = None
        if draft_path is not None:
            draft_backend = choose_backend(backend, draft_path, device)
            d = load_model(draft_path, draft_backend, dtype=dtype, device=device,
                           max_seq_len=t.model.max_seq_len)
            if draft_backend == "llama.cpp":
                info.draft = f"{draft_path} (llama.cpp, GGUF weights)"
            else:
                if draft_quant == "int8":
                    quantize_int8(d.model)
                info.draft = f"{draft_path} ({draft_quant if draft_quant != 'none' else dtype})"
            info.seconds["draft"], info.from_cache["draft"] = d.load_seconds, d.from_cache
            proposer = make_draft_model_drafter(d.model, d.tokenizer, t.model, t.tokenizer,
                                                confidence_threshold=draft_confidence)
        controller = None
        if adaptive and drafter != "none":
            costs = measured_costs(t.model, proposer, info, k, (target_path, draft_path))
            if drafter == "auto":
                proposer, info.choice = choose_drafter(costs, proposer, k)
            ngram = None if drafter == "draft-model" else NgramDrafter(max_n=ngram_max,
                                                                       min_n=ngram_min)
            controller = make_controller(costs, ngram, proposer)
            info.drafter = "+".join(slot.name for slot in controller.slots)
            if proposer is None:
                info.draft = None
            note = f"each step's drafter and length from observed costs ({controller.describe(k)})"
            info.choice = f"{info.choice}; {note}" if info.choice else note
            proposer = None
        elif drafter == "ngram":
            proposer = NgramDrafter(max_n=ngram_max, min_n=ngram_min)
        return cls(t.model, t.tokenizer, proposer, k, info, controller)

    # -- prompts ----------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               chat: bool = False) -> list[int]:
        """Raw prompt, prompt as one user message (chat=True), or whole conversation."""
        if messages is not None:
            return self.tokenizer.chat(messages)
        if prompt is None:
            raise ValueError("give a prompt or messages")
        if chat:
            return self.tokenizer.chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    # -- generation ---------------------------------------------------------------

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        speculative: bool = True,
    ) -> Iterator[TextChunk]:
        decoder = self.decoder if speculative else self.plain
        text = TextStream(self.tokenizer, params.stop)
        hook = text.stop_hook if params.stop else None  # the same decoded text
        for event in decoder.stream(prompt_ids, params, seed, stop_hook=hook):
            delta = text.push(event.token_ids)
            if event.finish_reason:
                delta += text.finish()
            yield TextChunk(delta, event.token_ids, event.finish_reason, event.stats)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        speculative: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> TextResult:
        """Generate to a stop; `on_text` sees each safe-to-show text delta as it comes."""
        start = time.perf_counter()
        parts, ids = [], []
        for chunk in self.stream(prompt_ids, params, seed, speculative):
            if on_text is not None:
                on_text(chunk.text)
            parts.append(chunk.text)
            ids += chunk.token_ids
        return TextResult("".join(parts), ids, chunk.finish_reason or "length", chunk.stats,
                          len(prompt_ids), time.perf_counter() - start)


def measured_costs(target: CausalLM, drafter: Drafter | None, info: LoadInfo, k: int,
                   files: tuple[Path, Path | None]) -> CostModel:
    """The target's cost curve (and the draft model's per-token cost), cached per
    model files, backend, threads and machine; recorded in `info.costs`."""
    from specdecode.costs import cached_costs, cpu_name

    draft = getattr(drafter, "model", None)
    stamps = [(str(f), f.stat().st_size if f.is_file() else None) for f in files if f]
    key = "|".join(map(str, (info.backend, repr(target), torch.get_num_threads(), info.draft,
                             stamps, cpu_name())))
    start = time.perf_counter()
    costs, cached = cached_costs(target, draft, key=key, max_k=max(k, 32))
    info.seconds["costs"] = time.perf_counter() - start
    info.costs = {"c": {b: round(c, 3) for b, c in costs.verify.items()},
                  "c_draft": round(costs.draft_per_token, 3), "from_cache": cached}
    return costs


KEEP_DRAFT_MODEL = 1.1  # predicted speed-up at 90 % acceptance that keeps it loaded


def choose_drafter(
    costs: CostModel, draft: Drafter | None, k: int
) -> tuple[Drafter | None, str]:
    """(the draft-model drafter or None, why) for drafter "auto", which always has
    n-gram lookup (free) and adds the draft model when its start-up costs predict
    KEEP_DRAFT_MODEL or more at 90 % acceptance; otherwise the model is closed
    (its memory freed). The controller then uses it only at steps where it pays
    on observed costs and pauses it where it does not."""
    if draft is None:
        return None, "n-gram lookup (no draft model)"
    length, rate = best_length(costs, [0.9] * k, k)
    why = (f"draft model: c_draft {costs.draft_per_token:.2f} plain steps per token; "
           f"at 90 % acceptance its best draft length {length} gives {rate:.2f}x")
    if rate >= KEEP_DRAFT_MODEL:
        return draft, f"n-gram lookup + the {why}"
    close = getattr(draft.model, "close", None)
    if close is not None:
        close()
    return None, f"n-gram lookup only ({why}, too little to pay)"


def make_controller(costs: CostModel, ngram: Drafter | None, draft: Drafter | None
                    ) -> Controller:
    """The adaptive engine's controller: n-gram lookup judged as free, the draft
    model priced per token, both on costs learnt online from the start-up prior."""
    slots = []
    if ngram is not None:
        slots.append(Slot(ngram, LengthPolicy(CostModel(costs.verify, 0.0)), costly=False))
    if draft is not None:
        slots.append(Slot(draft, LengthPolicy(costs), costly=True))
    return Controller(slots, costs)


def choose_backend(backend: str, path: Path, device: str) -> str:
    """"torch" or "llama.cpp" for one model file/folder (see `LLM.load`)."""
    from specdecode.models import llama_cpp

    gguf, cpu = path.is_file() and path.suffix == ".gguf", str(device).startswith("cpu")
    if backend == "auto":
        # llama.cpp for GGUF on CPU when installed: 3x the torch path's speed here.
        return "llama.cpp" if gguf and cpu and llama_cpp.available() else "torch"
    if backend == "llama.cpp":
        if not gguf:
            raise ValueError(f"the llama.cpp backend runs GGUF files; {path} is not one")
        if not cpu:
            raise ValueError(f"the llama.cpp backend runs on cpu only, not {device}")
        if not llama_cpp.available():
            raise ValueError("the llama.cpp backend is not built here: run "
                             "`specdecode build-llama-cpp` (once, about 9 minutes)")
    return backend


def load_model(
    path: Path, backend: str, *, dtype: str, device: str, max_seq_len: int | None
) -> Loaded:
    """One model (and its tokenizer) through the chosen backend."""
    from specdecode.models import loading

    if backend == "torch":
        return loading.load(path, dtype=dtype, device=device, max_seq_len=max_seq_len)
    from specdecode.models.llama_cpp import LlamaCppLM

    start = time.perf_counter()
    model = LlamaCppLM(path, max_seq_len=max_seq_len)
    tokenizer = loading.load_tokenizer(path)
    return Loaded(model, tokenizer, path, time.perf_counter() - start, from_cache=True)


def make_draft_model_drafter(
    draft: CausalLM,
    draft_tokenizer: Tokenizer,
    target: CausalLM,
    target_tokenizer: Tokenizer,
    confidence_threshold: float = 0.0,
) -> DraftModelDrafter:
    """A draft-model drafter after checking that both models share one vocabulary."""
    if draft_tokenizer.hf.get_vocab() != target_tokenizer.hf.get_vocab():
        raise VocabularyMismatch(
            f"the draft model's vocabulary ({draft_tokenizer.vocab_size} tokens) does not "
            f"match the target's ({target_tokenizer.vocab_size} tokens)")
    shared = None
    if draft.vocab_size != target.vocab_size:
        shared = target_tokenizer.vocab_size  # tables differ by padding only
    return DraftModelDrafter(draft, target, shared_vocab_size=shared,
                             confidence_threshold=confidence_threshold)
