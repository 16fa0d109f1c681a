"""LLM: a target, a drafter and a tokenizer behind one text-level API.

This is what the CLI and the server use: load models by registry name or
path, turn prompts or chat messages into ids, generate or stream text with
stop strings, and run plain decoding of the same request for comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.drafters import DraftModelDrafter, NgramDrafter, VocabularyMismatch
from specdecode.drafters.base import Drafter
from specdecode.engine import SpeculativeDecoder
from specdecode.models.base import CausalLM
from specdecode.models.loading import Loaded
from specdecode.models.quant import quantize_int8, worth_it
from specdecode.sampling import SamplingParams
from specdecode.stats import SpecStats
from specdecode.text import StopStrings, TextStream, Tokenizer

DRAFTERS = ("draft-model", "ngram", "none")
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
    ) -> None:
        eos = tuple(dict.fromkeys((*target.eos_token_ids, *tokenizer.eos_token_ids)))
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.decoder = SpeculativeDecoder(target, drafter, k, eos_token_ids=eos)
        self.plain = SpeculativeDecoder(target, None, 0, eos_token_ids=eos)
        self.info = info or LoadInfo(target="?")

    @property
    def k(self) -> int:
        return self.decoder.k

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
        ngram_max: int = 3,
        ngram_min: int = 1,
        draft_quant: str = "auto",
        draft_confidence: float = 0.3,
        backend: str = "auto",
    ) -> LLM:
        """Load by registry name or path. `drafter` defaults to draft-model when a
        draft model is given (or the target is a registry pair), else none.
        k defaults to 8 for a draft model and 16 for n-gram lookup (its drafts cost
        nothing, and copied text runs long).

        draft_quant: "int8" (weight-only, half the bytes per draft token),
        "none", or "auto" (int8 on CPU in bf16/fp16). It changes only the acceptance rate,
        never the output. draft_confidence: stop a draft after a token the draft
        model gave less than this probability (0 = always draft k).

        backend: "torch" (the native PyTorch model: any device, `dtype` applies),
        "llama.cpp" (GGUF files on CPU through llama-cpp-python, the GGUF's own
        quantised weights; `dtype` and `draft_quant` do not apply), or "auto"
        (torch for now; see `choose_backend`). Chosen per model."""
        from specdecode.models import registry

        if drafter is not None and drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter '{drafter}'; choose one of {', '.join(DRAFTERS)}")
        if draft_model is None and target in registry.PAIRS and drafter in (None, "draft-model"):
            draft_model = registry.PAIRS[target][1]
        if drafter is None:
            drafter = "draft-model" if draft_model else "none"
        if k is None:
            k = 16 if drafter == "ngram" else 8
        if drafter == "draft-model" and not draft_model:
            raise ValueError("--drafter draft-model needs --draft-model")
        if draft_quant not in ("auto", "int8", "none"):
            raise ValueError(f"unknown draft quantisation '{draft_quant}'; choose auto, int8, none")
        if draft_quant == "auto":
            draft_quant = "int8" if worth_it(device, dtype) else "none"
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
        target_path = registry.resolve(target)
        draft_path = registry.resolve(draft_model) if drafter == "draft-model" else None

        target_backend = choose_backend(backend, target_path, device)
        info = LoadInfo(target=str(target_path), drafter=drafter, backend=target_backend)
        t = load_model(target_path, target_backend, dtype=dtype, device=device,
                       max_seq_len=max_seq_len)
        info.seconds["target"], info.from_cache["target"] = t.load_seconds, t.from_cache
        proposer: Drafter | None = None
        if drafter == "draft-model":
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
        elif drafter == "ngram":
            proposer = NgramDrafter(max_n=ngram_max, min_n=ngram_min)
        return cls(t.model, t.tokenizer, proposer, k, info)

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
        hook = StopStrings(self.tokenizer, params.stop) if params.stop else None
        text = TextStream(self.tokenizer, params.stop)
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


def choose_backend(backend: str, path: Path, device: str) -> str:
    """"torch" or "llama.cpp" for one model file/folder (see `LLM.load`)."""
    from specdecode.models import llama_cpp

    gguf, cpu = path.is_file() and path.suffix == ".gguf", str(device).startswith("cpu")
    if backend == "auto":
        # torch until llama.cpp is both exact and fast here: its verification batches of
        # 8+ tokens run other kernels than one-token steps (greedy output can change),
        # and the AMX-less fallback this VM needs is slower than the torch path.
        return "torch"
    if backend == "llama.cpp":
        if not gguf:
            raise ValueError(f"the llama.cpp backend runs GGUF files; {path} is not one")
        if not cpu:
            raise ValueError(f"the llama.cpp backend runs on cpu only, not {device}")
        if not llama_cpp.available():
            raise ValueError("the llama.cpp backend needs llama-cpp-python: "
                             "pip install 'specdecode[cpu]'")
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
