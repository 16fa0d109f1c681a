"""The load plan: a LoadSpec resolved into what to build, by one pure function.

`resolve(spec, facts)` decides, without loading anything, which model files
run on which backend, which drafters are built, k, the n-gram lengths, the
draft model's quantisation and whether the engine is adaptive. All it needs
to know about the machine comes in `facts` (registry lookups, whether the
llama.cpp backend is built, $SPECDECODE_BACKEND): `Facts.here()` gathers them,
a test passes its own. Every invalid combination is an OptionError in API terms.

The rules are tables, not branches on names: `BACKENDS` (what each backend
can run, and the order "auto" tries them in) and `DRAFTERS` (what each drafter
builds, whether it needs a draft model, its default k).

The adaptive default. When `adaptive` is not given (and a drafter is), the plan
is the adaptive one with `fixed` holding the fixed-k plan; which one runs is
decided after the target is loaded, from its cost curve c(b) (one forward over
b tokens, in plain steps; costs.py), by `settle`: a steep curve (c(8) above
FLAT_C8) means drafts must be sized to what pays, so adaptive; a flat one
means a long fixed draft costs little, so fixed k. A backend whose
`measures_at_load` is set (llama.cpp, whose adaptive default measured the curve
at load anyway) measures it; the others (torch) use a cached curve only, and
keep fixed k when none is cached, so a default load costs no measurement it did
not cost before. A drafter "auto" is adaptive when `adaptive` is not given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from specdecode.options import LoadSpec, OptionError


@dataclass(frozen=True)
class Backend:
    """What a backend can run. measures_at_load: whether the adaptive default may
    measure the target's cost curve at load (else it reads a cached one only)."""

    gguf_only: bool
    cpu_only: bool
    needs_build: bool  # runs only where `Facts.llama_cpp()` says it is built
    measures_at_load: bool


BACKENDS: dict[str, Backend] = {
    "llama.cpp": Backend(gguf_only=True, cpu_only=True, needs_build=True, measures_at_load=True),
    "torch": Backend(gguf_only=False, cpu_only=False, needs_build=False, measures_at_load=False),
}
AUTO_ORDER = ("llama.cpp", "torch")  # "auto": the first that can run the model


@dataclass(frozen=True)
class DrafterRule:
    """builds: the drafters made (controller slot order); needs_draft: a draft model
    must be given; uses_draft: the draft model is loaded when given; chooses: keeps
    the draft model only where its start-up costs say it can pay and picks each
    step's drafter from observed costs, so it is adaptive (and only adaptive);
    k: default k as (fixed, adaptive)."""

    builds: tuple[str, ...]
    needs_draft: bool
    uses_draft: bool
    chooses: bool
    k: tuple[int, int]


# auto: both lookups, each step taking the one whose cut draft pays most (which one leads
# flipped between two timed runs on every workload but agent, where suffix led:
# bench/results/agent-and-lookups.md, auto-both-lookups.md), and the draft model where
# it pays.
# k: a draft model's drafts cost a forward each (8); n-gram drafts cost nothing and
# copied text runs long (16); adaptive, k is a cap: long copies pay even at c(65) ~ 10.
DRAFTERS: dict[str, DrafterRule] = {
    "auto": DrafterRule(("ngram", "suffix", "draft-model"), False, True, True, (16, 64)),
    "draft-model": DrafterRule(("draft-model",), True, True, False, (8, 8)),
    "ngram": DrafterRule(("ngram",), False, False, False, (16, 64)),
    "suffix": DrafterRule(("suffix",), False, False, False, (16, 64)),
    "hidden-head": DrafterRule(("hidden-head",), False, False, False, (3, 4)),
    "eagle3": DrafterRule(("eagle3",), False, False, False, (3, 4)),
    "none": DrafterRule((), False, False, False, (8, 8)),
}
LOOKUPS = ("ngram", "suffix")  # the free drafters, in controller slot order
NGRAM_MAX = (3, 8)  # (fixed, adaptive): the policy needs precise matches more than many
FLAT_C8 = 1.3  # c(8) in plain steps at or below which the curve is flat: fixed k


@dataclass(frozen=True)
class Facts:
    """What resolution needs to know about this machine. locate: registry name or
    path -> model path (registry.resolve); is_gguf: whether a path is a GGUF file;
    llama_cpp: whether the llama.cpp backend is built; env_backend:
    $SPECDECODE_BACKEND; pairs: registry pair name -> (target, draft)."""

    locate: Callable[[str | os.PathLike], Path]
    is_gguf: Callable[[Path], bool]
    llama_cpp: Callable[[], bool]
    env_backend: str | None
    pairs: Mapping[str, tuple[str, str]]

    @classmethod
    def here(cls) -> Facts:
        """This machine's facts (the registry, the llama.cpp build, the environment)."""
        from specdecode.models import llama_cpp, registry

        return cls(locate=registry.resolve, is_gguf=lambda p: p.is_file() and p.suffix == ".gguf",
                   llama_cpp=llama_cpp.available,
                   env_backend=os.environ.get("SPECDECODE_BACKEND") or None, pairs=registry.PAIRS)


@dataclass(frozen=True)
class ModelPlan:
    """One model to load: as named by the user, its local path, the backend that runs it."""

    name: str
    path: Path
    backend: str


@dataclass(frozen=True)
class Plan:
    """What `LLM.load` builds. drafter: the spec's drafter resolved (auto | draft-model
    | ngram | none); drafters: the drafters built, in controller slot order ("ngram",
    "suffix", "draft-model"); adaptive: the closed-loop controller (else one drafter,
    fixed k); draft_quant: int8 | none; fixed: when `adaptive` was not given, the fixed-k plan
    `settle` takes instead of this one on a flat cost curve (None: decided)."""

    spec: LoadSpec
    target: ModelPlan
    draft: ModelPlan | None
    drafter: str
    drafters: tuple[str, ...]
    k: int
    adaptive: bool
    ngram_max: int
    ngram_min: int
    draft_quant: str
    fixed: Plan | None = None

    @property
    def measures_at_load(self) -> bool:
        """Whether an undecided plan measures the target's cost curve (else: cache only)."""
        return BACKENDS[self.target.backend].measures_at_load


def choose_backend(requested: str, path: Path, device: str, facts: Facts) -> str:
    """"torch" or "llama.cpp" for one model: `requested` itself when it can run the
    model (else OptionError saying why), or for "auto" the first of AUTO_ORDER that can."""
    if requested == "auto":
        return next(name for name in AUTO_ORDER if _why_not(name, path, device, facts) is None)
    why = _why_not(requested, path, device, facts)
    if why is not None:
        raise OptionError(why)
    return requested


def _why_not(name: str, path: Path, device: str, facts: Facts) -> str | None:
    """Why backend `name` cannot run `path` on `device` (None: it can)."""
    rule = BACKENDS[name]
    if rule.gguf_only and not facts.is_gguf(path):
        return f"the {name} backend runs GGUF files; {path} is not one"
    if rule.cpu_only and not str(device).startswith("cpu"):
        return f"the {name} backend runs on cpu only, not {device}"
    if rule.needs_build and not facts.llama_cpp():
        return (f"the {name} backend is not built here: run `specdecode build-llama-cpp` "
                "(once, about 9 minutes)")
    return None


def requested_backend(spec: LoadSpec, facts: Facts) -> str:
    """The spec's backend, else $SPECDECODE_BACKEND, else "auto"."""
    backend = spec.backend or facts.env_backend or "auto"
    if backend not in ("auto", *BACKENDS):
        raise OptionError(f"unknown <backend> '{backend}' (from $SPECDECODE_BACKEND); choose "
                          f"one of auto, {', '.join(BACKENDS)}")
    return backend


def draft_model(spec: LoadSpec, facts: Facts) -> str | os.PathLike | None:
    """The spec's draft model, else its pair's when the target is a registry pair and
    the drafter may use one (None: no draft model)."""
    if spec.draft_model is None and spec.drafter in (None, "draft-model", "auto"):
        return facts.pairs.get(spec.target, (None, None))[1]
    return spec.draft_model


def resolve(spec: LoadSpec, facts: Facts) -> Plan:
    """The plan for `spec` on a machine with `facts` (see the module docstring)."""
    backend, draft_name = requested_backend(spec, facts), draft_model(spec, facts)
    path = facts.locate(spec.target)
    target = ModelPlan(str(spec.target), path, choose_backend(backend, path, spec.device, facts))
    draft = None
    if draft_name is not None and DRAFTERS[_drafter(spec, draft_name, True)].uses_draft:
        draft_path = facts.locate(draft_name)
        draft = ModelPlan(str(draft_name), draft_path,
                          choose_backend(backend, draft_path, spec.device, facts))
    adaptive = spec.adaptive if spec.adaptive is not None else (
        True if spec.drafter and DRAFTERS[spec.drafter].chooses else None)
    if adaptive is not None or _drafter(spec, draft_name, False) == "none":
        return _settled(spec, target, draft, bool(adaptive))
    return replace(_settled(spec, target, draft, True),
                   fixed=_settled(spec, target, draft, False))


def _drafter(spec: LoadSpec, draft_name: object, adaptive: bool) -> str:
    """The spec's drafter, or its default: draft-model ("auto" when adaptive) if a draft
    model is known, else none."""
    if spec.drafter is not None:
        return spec.drafter
    if draft_name is None:
        return "none"
    return "auto" if adaptive else "draft-model"


def _settled(spec: LoadSpec, target: ModelPlan, draft: ModelPlan | None,
             adaptive: bool) -> Plan:
    """The plan with `adaptive` decided: the drafter, k and n-gram defaults that follow."""
    from specdecode.models.quant import worth_it

    drafter = _drafter(spec, draft and draft.name, adaptive)
    rule = DRAFTERS[drafter]
    if rule.chooses and not adaptive:
        raise OptionError(f"<drafter> '{drafter}' chooses each step's drafter from measured "
                          "costs: it cannot run with <adaptive> off")
    if rule.needs_draft and draft is None:
        raise OptionError(f"<drafter> '{drafter}' needs a <draft_model>")
    heads = ("hidden-head", "eagle3")
    if (drafter in heads) != (spec.head is not None):
        raise OptionError(f"<drafter> '{drafter}' needs a <head>" if spec.head is None
                          else "<head> is a trained head's: set <drafter> hidden-head or "
                          f"eagle3 (not {drafter})")
    if drafter == "eagle3" and target.backend != "torch":
        raise OptionError("<drafter> 'eagle3' reads the hidden states of inner layers, which "
                          f"only the torch backend exposes (not {target.backend}): set "
                          "<backend> torch, or train a hidden-head for llama.cpp")
    draft = draft if rule.uses_draft else None
    builds = tuple(d for d in rule.builds if d != "draft-model" or draft is not None)
    ngram_max = spec.ngram_max if spec.ngram_max is not None else NGRAM_MAX[adaptive]
    if set(LOOKUPS) & set(builds) and spec.ngram_min > ngram_max:
        raise OptionError(f"<ngram_min> {spec.ngram_min} exceeds <ngram_max> {ngram_max}")
    quant = spec.draft_quant
    if quant == "auto":
        quant = "int8" if worth_it(spec.device, spec.dtype) else "none"
    return Plan(spec, target, draft, drafter, builds, spec.k if spec.k is not None
                else rule.k[adaptive], adaptive, ngram_max, spec.ngram_min, quant)


def is_steep(curve: Mapping[int, float] | Callable[[int], float]) -> bool:
    """Whether a cost curve (c(b) in plain steps: a mapping, or a function such as
    CostModel.c) makes a verification of 8 tokens cost more than FLAT_C8 plain steps."""
    c = curve if callable(curve) else curve.__getitem__
    return c(8) > FLAT_C8


def settle(plan: Plan, curve: Mapping[int, float] | Callable[[int], float] | None) -> Plan:
    """The plan that runs: `plan` when it is decided; else (adaptive not given) the
    adaptive plan on a steep curve, the fixed-k plan on a flat one or with no curve."""
    if plan.fixed is None:
        return plan
    return plan if curve is not None and is_steep(curve) else plan.fixed
