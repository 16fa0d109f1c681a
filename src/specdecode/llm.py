"""LLM: a target, a drafter and a tokenizer behind one text-level API.

This is what the CLI and the server use: load models by registry name or
path, turn prompts or chat messages into ids, generate or stream text with
stop strings, and run plain decoding of the same request for comparison.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdecode import threads
from specdecode.controller import Controller, Slot
from specdecode.drafters import (
    DraftModelDrafter,
    NgramDrafter,
    SuffixDrafter,
    SuffixStore,
    VocabularyMismatch,
)
from specdecode.drafters.base import Drafter
from specdecode.engine import SpeculativeDecoder
from specdecode.models.base import CausalLM
from specdecode.models.loading import Loaded
from specdecode.models.quant import quantize_int8
from specdecode.options import BACKENDS, DRAFTERS, LoadSpec
from specdecode.plan import DRAFTERS as DRAFTER_RULES
from specdecode.plan import LOOKUPS, Facts, Plan, resolve, settle
from specdecode.sampling import SamplingParams
from specdecode.speclen import CostModel, LengthPolicy, best_length
from specdecode.stats import SpecStats
from specdecode.text import TextStream, Tokenizer

__all__ = ["BACKENDS", "DRAFTERS", "LLM", "LoadInfo", "LoadSpec", "TextChunk", "TextResult"]


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
    memory: dict | None = None  # the memory plan checked before loading (memory.py)


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
        head: str | None = None,
    ) -> LLM:
        """Load by registry name or path: `LLM.from_spec` of the LoadSpec these keyword
        arguments make (options.py says what each means; plan.py the defaults).

        In short: `drafter` defaults to draft-model when a draft model is given (or
        the target is a registry pair), else none; "auto" (the adaptive default with
        a draft model) has n-gram and suffix lookup (drafters/suffix.py: this
        request's text and earlier requests') plus the draft model while its
        measured costs say it can pay. k defaults to 8 for a draft model, 16 for
        n-gram and suffix lookup (64 when adaptive: a cap), ngram_max to 3 (8 when
        adaptive).
        adaptive: each step's drafter and draft length from observed costs
        (controller.py); None: from the target's cost curve, measured at load on
        llama.cpp (adaptive when c(8) > 1.3 plain steps) and read from the cache only
        on torch (fixed k when none is cached). draft_quant: int8 | none | auto (int8
        on CPU in bf16/fp16; never changes the output). draft_confidence: stop a
        draft after a token the draft model gave less than this probability.
        backend: torch | llama.cpp | auto (llama.cpp for GGUF files on CPU when
        built, else torch; None: $SPECDECODE_BACKEND, else auto), chosen per model.
        head: a trained hidden-state head's folder, for drafter "hidden-head".
        `info.choice` says what was chosen from costs. Bad options raise
        OptionError (a ValueError) naming the keyword argument."""
        return cls.from_spec(LoadSpec(
            target, draft_model, drafter, k, backend, dtype, device, max_seq_len, ngram_max,
            ngram_min, draft_quant, draft_confidence, adaptive, head))

    @classmethod
    def from_spec(cls, spec: LoadSpec, facts: Facts | None = None) -> LLM:
        """Check the device (options.py) and sizes (limits.py), resolve the plan (plan.py),
        refuse it if its memory plan does not fit (memory.py), load its models and build
        it."""
        from specdecode import limits
        from specdecode.memory import plan_memory
        from specdecode.options import check_device

        check_device(spec.device)  # OptionError naming <device>, before anything is read
        limits.check_load(spec.target, k=spec.k, max_seq_len=spec.max_seq_len,
                          dtype=spec.dtype, device=spec.device, backend=spec.backend)
        plan = resolve(spec, facts or Facts.here())
        memory = plan_memory(plan)
        memory.check()
        llm = cls.build(plan, load_plan(plan))
        llm.info.memory = memory.to_dict()
        return llm

    @classmethod
    def build(cls, plan: Plan, models: LoadedModels) -> LLM:
        """The LLM `plan` describes, on models loaded for it (or for a plan with the same
        target and draft: the bench builds its rows on one load). An undecided
        adaptive default is settled here, from the target's cost curve."""
        info, undecided = models.new_info(), plan.fixed is not None
        plan, costs, why = _settle(plan, models, info)
        info.drafter, choice = plan.drafter, None
        drafters = {name: models.drafter(name, plan) for name in plan.drafters}
        if not (plan.adaptive and drafters):
            only = next(iter(drafters.values()), None)
            if not (undecided and only is not None and plan.k > 0):
                info.choice = why
                return cls(models.target.model, models.target.tokenizer, only, plan.k, info)
            controller = guarded_controller(only, costs or flat_prior(models, only))
            info.choice = "; ".join(filter(None, (why, f"drafts of up to k = {plan.k} "
                                                  "while they pay (acceptance-collapse guard)")))
            return cls(models.target.model, models.target.tokenizer, None, plan.k, info,
                       controller)
        draft = drafters.get("draft-model")
        if costs is None:
            costs = measured_costs(models.target.model, draft, info, plan.k, models.files)
        if DRAFTER_RULES[plan.drafter].chooses:
            draft, choice = choose_drafter(costs, draft, plan.k)
        heads = [(d, share) for d in drafters.values() if (share := head_share(models, d))]
        if draft is None and heads:  # a trained head: priced by its own size
            draft, share = heads[0]
            costs = replace(costs, draft_per_token=share)
        lookups = [drafters[name] for name in LOOKUPS if name in drafters]
        controller = make_controller(costs, lookups, draft)
        info.drafter = "+".join(slot.name for slot in controller.slots)
        if draft is None:
            info.draft = None
        note = f"each step's drafter and length from observed costs ({controller.describe(plan.k)})"
        info.choice = "; ".join(filter(None, (choice, note, why)))
        return cls(models.target.model, models.target.tokenizer, None, plan.k, info, controller)

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
    from specdecode.costs import cached_costs

    start = time.perf_counter()
    costs, cached = cached_costs(target, getattr(drafter, "draft_model", None),
                                 key=_costs_key(target, info, files), max_k=max(k, 32))
    info.seconds["costs"] = time.perf_counter() - start
    _record_costs(info, costs, cached)
    return costs


def cached_prior(target: CausalLM, info: LoadInfo, k: int,
                 files: tuple[Path, Path | None]) -> CostModel | None:
    """The cost curve `measured_costs` would find in its cache, without measuring
    (None: not cached); recorded in `info.costs` when found."""
    from specdecode.costs import read_cached

    costs = read_cached(target, key=_costs_key(target, info, files), max_k=max(k, 32))
    if costs is not None:
        _record_costs(info, costs, True)
    return costs


def _costs_key(target: CausalLM, info: LoadInfo, files: tuple[Path, Path | None]) -> str:
    """A cost curve's cache key: backend, target, threads, draft, model files, CPU."""
    from specdecode.costs import cpu_name

    stamps = [(str(f), f.stat().st_size if f.is_file() else None) for f in files if f]
    return "|".join(map(str, (info.backend, repr(target), torch.get_num_threads(), info.draft,
                              stamps, cpu_name())))


def _record_costs(info: LoadInfo, costs: CostModel, cached: bool) -> None:
    info.costs = {"c": {b: round(c, 3) for b, c in costs.verify.items()},
                  "c_draft": round(costs.draft_per_token, 3), "from_cache": cached}


KEEP_DRAFT_MODEL = 1.1  # predicted speed-up at 90 % acceptance that keeps it loaded


def choose_drafter(
    costs: CostModel, draft: Drafter | None, k: int
) -> tuple[Drafter | None, str]:
    """(the draft-model drafter or None, why) for drafter "auto", which always has
    n-gram and suffix lookup (free) and adds the draft model when its start-up costs
    predict KEEP_DRAFT_MODEL or more at 90 % acceptance; otherwise the model is closed
    (its memory freed). The controller then uses it only at steps where it pays
    on observed costs and pauses it where it does not."""
    if draft is None:
        return None, "n-gram and suffix lookup (no draft model)"
    length, rate = best_length(costs, [0.9] * k, k)
    why = (f"draft model: c_draft {costs.draft_per_token:.2f} plain steps per token; "
           f"at 90 % acceptance its best draft length {length} gives {rate:.2f}x")
    if rate >= KEEP_DRAFT_MODEL:
        return draft, f"n-gram and suffix lookup + the {why}"
    draft.close()  # frees the draft model's memory (BaseDrafter.close)
    return None, f"n-gram and suffix lookup only ({why}, too little to pay)"


def make_controller(costs: CostModel, lookups: Sequence[Drafter], draft: Drafter | None
                    ) -> Controller:
    """The adaptive engine's controller: lookup drafters (n-gram, suffix) judged as
    free, each step taking the one whose cut draft pays most (each kind of match
    from its own prior, the drafter's kind_priors), and the draft model priced per
    token, all on costs learnt online from the start-up prior."""
    slots = [Slot(lookup, LengthPolicy(CostModel(costs.verify, 0.0)), costly=False)
             for lookup in lookups]
    if draft is not None:
        slots.append(Slot(draft, LengthPolicy(costs), costly=True))
    return Controller(slots, costs)


def guarded_controller(drafter: Drafter, costs: CostModel) -> Controller:
    """The fixed-k default's controller: `drafter` alone in make_controller's slot for
    its kind (a draft model priced per token, any other drafter free), drafts of up
    to k tokens, each step's length from observed costs and acceptance, so that
    drafts which stop paying engage the acceptance-collapse guard (collapse.py) as
    in the adaptive engine. As fixed k: the first draft is not a one-token probe
    (probes come after pauses), and a draft model is priced without its catch-up
    (controller.Slot.prices_catchup)."""
    draft = drafter if is_priced(drafter) else None
    controller = make_controller(costs, [] if draft else [drafter], draft)
    for slot in controller.slots:
        slot.probing = slot.prices_catchup = False
    return controller


def is_priced(drafter: Drafter) -> bool:
    """Whether the controller prices this drafter's tokens (drafters.base: priced)."""
    return (getattr(drafter, "draft_model", None) is not None
            or bool(getattr(drafter, "priced", False)))


def head_share(models: LoadedModels, drafter: Drafter) -> float | None:
    """A trained head's draft token in plain steps, by the weight bytes one head step
    reads over those of one target step (a torch target's parameters, else its
    file's; None: not a head). The embedding table is the target's: a step reads
    one row of it, so it is not counted."""
    from specdecode.memory import files_bytes

    head, target = getattr(drafter, "head", None), models.target.model
    if not isinstance(head, torch.nn.Module):
        return None
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    whole = size(target) if isinstance(target, torch.nn.Module) else files_bytes(
        models.files[0])
    return size(head) / max(whole, 1)


def flat_prior(models: LoadedModels, drafter: Drafter) -> CostModel:
    """A cost prior measured nothing: verification as cheap as a plain step (the flat
    curve the fixed-k default is for) and a draft model's token priced at its share
    of the target's weight bytes (what a CPU step reads); observed steps correct
    both (controller.OnlineCosts)."""
    from specdecode.memory import files_bytes

    target, draft = models.files
    share = head_share(models, drafter) or 0.0
    if getattr(drafter, "draft_model", None) is not None and draft is not None:
        share = files_bytes(draft) / max(files_bytes(target), 1)
    return CostModel({1: 1.0, 2: 1.0}, draft_per_token=share)


def choose_backend(backend: str, path: Path, device: str) -> str:
    """"torch" or "llama.cpp" for one model file/folder on this machine (plan.py's
    BACKENDS say what each can run)."""
    from specdecode import plan

    return plan.choose_backend(backend, Path(path), device, Facts.here())


def _load_torch(path: Path, *, dtype: str, device: str, max_seq_len: int | None) -> Loaded:
    from specdecode.models import loading

    return loading.load(path, dtype=dtype, device=device, max_seq_len=max_seq_len)


def _load_llama_cpp(path: Path, *, dtype: str, device: str, max_seq_len: int | None) -> Loaded:
    """The GGUF's own weights (`dtype` does not apply; the device is cpu); long passes
    (prompts, long verifications) on a plain-layout copy where that is measured to pay
    (models/llama_cpp_prefill.py)."""
    from specdecode.models import loading
    from specdecode.models.llama_cpp import LlamaCppLM

    start = time.perf_counter()
    model = LlamaCppLM(path, max_seq_len=max_seq_len, prefill_copy=None)
    tokenizer = loading.load_tokenizer(path)
    return Loaded(model, tokenizer, path, time.perf_counter() - start, from_cache=True)


def _torch_draft(loaded: Loaded, plan: Plan) -> str:
    """Quantise a torch draft model as planned; how its weights are held."""
    if plan.draft_quant == "int8":
        quantize_int8(loaded.model)
    return plan.draft_quant if plan.draft_quant != "none" else plan.spec.dtype


# Backends by name: (load one model, prepare a loaded draft model -> its description).
LOADERS: dict[str, tuple[Callable[..., Loaded], Callable[[Loaded, Plan], str]]] = {
    "torch": (_load_torch, _torch_draft),
    "llama.cpp": (_load_llama_cpp, lambda loaded, plan: "llama.cpp, GGUF weights"),
}


def load_model(
    path: Path, backend: str, *, dtype: str, device: str, max_seq_len: int | None
) -> Loaded:
    """One model (and its tokenizer) through the chosen backend."""
    threads.loaded(backend)  # the process's thread policy for the backends loaded so far
    return LOADERS[backend][0](path, dtype=dtype, device=device, max_seq_len=max_seq_len)


@dataclass
class LoadedModels:
    """A plan's models, loaded: the target, the draft model (None: none), what their
    load recorded (`info`) and the files the cost cache is keyed on. Several plans
    with this target and draft can be built on them (`LLM.build`): the draft-model
    drafter (and with it the draft model's cache) is made once and shared."""

    target: Loaded
    draft: Loaded | None
    info: LoadInfo
    files: tuple[Path, Path | None]
    drafters: dict[tuple, Drafter] = field(default_factory=dict)

    def new_info(self) -> LoadInfo:
        """A copy of the load's info for one LLM to fill in."""
        return replace(self.info, seconds=dict(self.info.seconds),
                       from_cache=dict(self.info.from_cache))

    def drafter(self, name: str, plan: Plan) -> Drafter:
        """Drafter `name` for `plan` through DRAFTER_FACTORIES: a new one, or the one
        made before for a plan with the same values of the factory's shared-by fields."""
        make, shared_by = DRAFTER_FACTORIES[name]
        if shared_by is None:
            return make(plan, self)
        key = (name, *(getattr(plan.spec, f) for f in shared_by))
        if key not in self.drafters:
            self.drafters[key] = make(plan, self)
        return self.drafters[key]


def _ngram_drafter(plan: Plan, models: LoadedModels) -> Drafter:
    return NgramDrafter(max_n=plan.ngram_max, min_n=plan.ngram_min)


def _suffix_drafter(plan: Plan, models: LoadedModels) -> Drafter:
    return SuffixDrafter(SuffixStore(), max_n=plan.ngram_max, min_n=plan.ngram_min)


def _draft_model_drafter(plan: Plan, models: LoadedModels) -> Drafter:
    t, d = models.target, models.draft
    return make_draft_model_drafter(d.model, d.tokenizer, t.model, t.tokenizer,
                                    confidence_threshold=plan.spec.draft_confidence)


def _hidden_head_drafter(plan: Plan, models: LoadedModels) -> Drafter:
    from specdecode.drafters.hidden_head import HiddenHeadDrafter, HiddenStateHead, target_embedding
    embed = target_embedding(models.target.model, plan.target.path)
    return HiddenHeadDrafter(HiddenStateHead.load(plan.spec.head, embed))


def _eagle3_drafter(plan: Plan, models: LoadedModels) -> Drafter:
    from specdecode.drafters.eagle import Eagle3Drafter
    from specdecode.train.speculators import load_any
    target = models.target.model
    return Eagle3Drafter(load_any(plan.spec.head, target.embed_tokens.weight,
                                  target.embed_tokens.weight.dtype))


# Drafters by name: (make one for a plan on loaded models, the LoadSpec fields that key
# one shared by several LLMs on the same models; None: a new one for each). The draft
# model's drafter is shared: it tracks what the draft model's KV cache holds.
DRAFTER_FACTORIES: dict[str, tuple[Callable[[Plan, LoadedModels], Drafter],
                                   tuple[str, ...] | None]] = {
    "ngram": (_ngram_drafter, None),
    "suffix": (_suffix_drafter, None),  # each LLM its own store of earlier requests
    "draft-model": (_draft_model_drafter, ("draft_confidence",)),
    "hidden-head": (_hidden_head_drafter, ("head",)),
    "eagle3": (_eagle3_drafter, None),  # its cache follows one request at a time
}


def load_plan(plan: Plan) -> LoadedModels:
    """Load the plan's target, then its draft model (prepared as its backend does)."""
    spec = plan.spec
    info = LoadInfo(target=str(plan.target.path), drafter=plan.drafter,
                    backend=plan.target.backend)
    t = load_model(plan.target.path, plan.target.backend, dtype=spec.dtype, device=spec.device,
                   max_seq_len=spec.max_seq_len)
    info.seconds["target"], info.from_cache["target"] = t.load_seconds, t.from_cache
    d = None
    if plan.draft is not None:
        load, prepare = LOADERS[plan.draft.backend]
        d = load(plan.draft.path, dtype=spec.dtype, device=spec.device,
                 max_seq_len=t.model.max_seq_len)
        info.draft = f"{plan.draft.path} ({prepare(d, plan)})"
        info.seconds["draft"], info.from_cache["draft"] = d.load_seconds, d.from_cache
    return LoadedModels(t, d, info, (plan.target.path, plan.draft and plan.draft.path))


def _settle(plan: Plan, models: LoadedModels, info: LoadInfo
            ) -> tuple[Plan, CostModel | None, str | None]:
    """(the plan that runs, its cost prior if measured or cached, why): an undecided
    adaptive default settled from the target's cost curve (plan.settle), measured
    where the backend measures at load, else read from the cache only."""
    if plan.fixed is None:
        return plan, None, None
    target, k = models.target.model, plan.k
    if plan.measures_at_load:
        draft = models.drafter("draft-model", plan) if "draft-model" in plan.drafters else None
        costs = measured_costs(target, draft, info, k, models.files)
    else:
        costs = cached_prior(target, info, k, models.files)
    chosen = settle(plan, costs and costs.c)
    if costs is None:
        return chosen, None, None
    why = (f"{'adaptive' if chosen.adaptive else 'fixed k'} by default: c(8) = "
           f"{costs.c(8):.2f} plain steps ({'steep' if chosen.adaptive else 'flat'} cost curve)")
    return chosen, costs, why


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
