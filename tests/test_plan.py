"""The load plan: LoadSpec validation, the pure resolution table, the adaptive default
from a cost curve, the registries, and building a plan (on tiny random models; no
model file is read anywhere in this file)."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import tiny
from specdecode import cli, options
from specdecode import llm as llm_module
from specdecode import plan as plan_module
from specdecode.bench.runner import BenchOptions, Config
from specdecode.drafters import DraftModelDrafter, NgramDrafter
from specdecode.llm import LLM, LoadedModels, LoadInfo
from specdecode.models.loading import Loaded
from specdecode.options import LoadSpec, OptionError
from specdecode.plan import BACKENDS, DRAFTERS, Facts, resolve, settle
from specdecode.speclen import CostModel

FILES = {"default": "/m/t.gguf", "t": "/m/t.gguf", "d": "/m/d.gguf", "hf": "/m/hf-folder"}


def facts(llama_cpp: bool = True, env: str | None = None) -> Facts:
    """A machine with a registry pair "default" = (t, d), GGUF files t, d and an HF
    folder hf; other names are paths as given."""
    return Facts(locate=lambda name: Path(FILES.get(str(name), str(name))),
                 is_gguf=lambda path: path.suffix == ".gguf", llama_cpp=lambda: llama_cpp,
                 env_backend=env, pairs={"default": ("t", "d")})


def plan(**kw):
    machine = facts(**kw.pop("_facts", {}))
    return resolve(LoadSpec(**kw), machine)


def shape(p) -> tuple:
    """(drafter, drafters, k, adaptive, ngram_max, target backend, draft backend)."""
    return (p.drafter, p.drafters, p.k, p.adaptive, p.ngram_max, p.target.backend,
            p.draft and p.draft.backend)


LL, T = "llama.cpp", "torch"


@pytest.mark.parametrize("spec, decided, undecided_fixed", [
    # registry pair, nothing set: the adaptive plan, and the fixed-k one for a flat curve
    ({}, ("auto", ("ngram", "suffix", "draft-model"), 64, True, 8, LL, LL),
     ("draft-model", ("draft-model",), 8, False, 3, LL, LL)),
    ({"backend": "torch"}, ("auto", ("ngram", "suffix", "draft-model"), 64, True, 8, T, T),
     ("draft-model", ("draft-model",), 8, False, 3, T, T)),
    # a draft model given: the same as a pair's
    ({"target": "t", "draft_model": "d", "adaptive": False},
     ("draft-model", ("draft-model",), 8, False, 3, LL, LL), None),
    ({"target": "t", "draft_model": "d", "adaptive": True},
     ("auto", ("ngram", "suffix", "draft-model"), 64, True, 8, LL, LL), None),
    ({"draft_model": "/x/other.gguf", "drafter": "draft-model", "k": 5, "adaptive": True},
     ("draft-model", ("draft-model",), 5, True, 8, LL, LL), None),
    # n-gram lookup: no draft model, even for a pair
    ({"drafter": "ngram"}, ("ngram", ("ngram",), 64, True, 8, LL, None),
     ("ngram", ("ngram",), 16, False, 3, LL, None)),
    ({"drafter": "ngram", "adaptive": False, "ngram_max": 5, "k": 7},
     ("ngram", ("ngram",), 7, False, 5, LL, None), None),
    # none: decided, whatever adaptive would be
    ({"drafter": "none"}, ("none", (), 8, False, 3, LL, None), None),
    ({"target": "t"}, ("none", (), 8, False, 3, LL, None), None),
    ({"target": "t", "k": 0}, ("none", (), 0, False, 3, LL, None), None),
    # auto: adaptive unless told otherwise; the lookups only without a draft model
    ({"drafter": "auto"}, ("auto", ("ngram", "suffix", "draft-model"), 64, True, 8, LL, LL), None),
    ({"target": "t", "drafter": "auto"},
     ("auto", ("ngram", "suffix"), 64, True, 8, LL, None), None),
    # backends: auto takes llama.cpp for GGUF on CPU when built, else torch; per model
    ({"_facts": {"llama_cpp": False}, "adaptive": False},
     ("draft-model", ("draft-model",), 8, False, 3, T, T), None),
    ({"device": "cuda", "adaptive": False},
     ("draft-model", ("draft-model",), 8, False, 3, T, T), None),
    ({"target": "hf", "draft_model": "d", "adaptive": False},
     ("draft-model", ("draft-model",), 8, False, 3, T, LL), None),
    ({"_facts": {"env": "torch"}, "adaptive": False},
     ("draft-model", ("draft-model",), 8, False, 3, T, T), None),
    ({"_facts": {"env": "torch"}, "backend": "auto", "adaptive": False},
     ("draft-model", ("draft-model",), 8, False, 3, LL, LL), None),
])
def test_resolution_table(spec, decided, undecided_fixed):
    p = plan(**spec)
    assert shape(p) == decided
    assert (p.fixed and shape(p.fixed)) == undecided_fixed
    assert p.fixed is None or p.fixed.fixed is None


def test_plan_details():
    p = plan()
    assert p.target == plan_module.ModelPlan("default", Path("/m/t.gguf"), "llama.cpp")
    assert p.draft == plan_module.ModelPlan("d", Path("/m/d.gguf"), "llama.cpp")
    assert p.measures_at_load and not plan(backend="torch").measures_at_load
    assert plan(backend="torch").draft_quant == "int8"  # auto: int8 on CPU in bf16
    assert plan(backend="torch", dtype="float32").draft_quant == "none"
    assert plan(backend="torch", device="cuda").draft_quant == "none"
    assert plan(backend="torch", draft_quant="none").draft_quant == "none"
    assert plan(drafter="ngram", ngram_min=2, adaptive=False).ngram_min == 2


@pytest.mark.parametrize("spec, param, needle", [
    ({"drafter": "magic"}, "drafter", "unknown drafter 'magic'"),
    ({"backend": "vulkan"}, "backend", "unknown backend 'vulkan'"),
    ({"draft_quant": "int4"}, "draft_quant", "unknown draft_quant 'int4'"),
    ({"dtype": "int8"}, "dtype", "unknown dtype 'int8'"),
    ({"k": -1}, "k", "k (num_speculative_tokens) must be an integer >= 0"),
    ({"k": 2.5}, "k", "got 2.5"),
    ({"k": True}, "k", "got True"),
    ({"max_seq_len": 0}, "max_seq_len", "max_seq_len must be an integer >= 1"),
    ({"max_seq_len": "512"}, "max_seq_len", "got '512'"),
    ({"ngram_max": 0}, "ngram_max", "ngram_max must be"),
    ({"ngram_min": 0}, "ngram_min", "ngram_min must be"),
    ({"draft_confidence": 1.5}, "draft_confidence", "in [0, 1]"),
    ({"draft_confidence": math.nan}, "draft_confidence", "in [0, 1]"),
    ({"draft_confidence": True}, "draft_confidence", "in [0, 1]"),
    ({"adaptive": "yes"}, "adaptive", "adaptive must be True, False or None"),
    # combinations, found by the resolution
    ({"target": "t", "drafter": "draft-model"}, "drafter",
     "drafter 'draft-model' needs a draft_model"),
    ({"drafter": "auto", "adaptive": False}, "drafter", "cannot run with adaptive off"),
    ({"drafter": "ngram", "ngram_min": 4, "adaptive": False}, "ngram_min",
     "ngram_min 4 exceeds ngram_max 3"),
    ({"drafter": "ngram", "ngram_min": 4, "ngram_max": 3, "adaptive": True}, "ngram_min",
     "exceeds ngram_max 3"),
    ({"target": "hf", "backend": "llama.cpp"}, None, "runs GGUF files; /m/hf-folder is not one"),
    ({"backend": "llama.cpp", "device": "cuda"}, None, "runs on cpu only, not cuda"),
    ({"backend": "llama.cpp", "_facts": {"llama_cpp": False}}, None, "is not built here"),
    ({"_facts": {"env": "vulkan"}}, "backend", "unknown backend 'vulkan' (from $SPECDECODE"),
])
def test_invalid_options_and_combinations(spec, param, needle):
    with pytest.raises(OptionError) as e:
        plan(**spec)
    assert isinstance(e.value, ValueError)
    assert needle in str(e.value) and e.value.param == param


def test_an_unused_draft_model_or_ngram_size_is_no_error():
    assert plan(drafter="none", draft_model="d", ngram_min=9).draft is None
    assert plan(drafter="draft-model", ngram_min=9, adaptive=False).drafters == ("draft-model",)


def test_resolution_reads_nothing_but_its_facts():
    seen = []
    f = replace(facts(), locate=lambda name: seen.append(name) or Path(FILES[str(name)]))
    resolve(LoadSpec(drafter="ngram"), f)
    assert seen == ["default"]  # n-gram lookup never locates (or pulls) the pair's draft
    resolve(LoadSpec(), f)
    assert seen == ["default", "default", "d"]


@pytest.mark.parametrize("c8, adaptive", [(1.0, False), (1.3, False), (1.31, True), (5.9, True)])
def test_adaptive_default_from_the_cost_curve(c8, adaptive):
    undecided = plan()
    curve = CostModel({1: 1.0, 8: c8, 9: c8 * 1.1})
    assert settle(undecided, curve.c).adaptive is adaptive
    assert settle(undecided, {1: 1.0, 8: c8}).adaptive is adaptive
    assert settle(undecided, None) is undecided.fixed  # no curve: fixed k
    decided = plan(adaptive=False)
    assert settle(decided, curve.c) is decided


def test_registries_cover_every_name():
    assert set(llm_module.LOADERS) == set(BACKENDS) == {"torch", "llama.cpp"}
    assert set(plan_module.AUTO_ORDER) == set(BACKENDS)
    assert set(DRAFTERS) == set(options.DRAFTERS)
    built = {name for rule in DRAFTERS.values() for name in rule.builds}
    assert built == set(llm_module.DRAFTER_FACTORIES) == {"ngram", "suffix", "draft-model",
                                                          "hidden-head", "eagle3"}


def test_eagle3_needs_a_head_and_torch(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OptionError, match="needs a head"):
        resolve(LoadSpec("default", drafter="eagle3"), facts())
    with pytest.raises(OptionError, match="only the torch backend"):
        resolve(LoadSpec("default", drafter="eagle3", head=tmp_path,
                         backend="llama.cpp"), facts())
    assert resolve(LoadSpec("default", drafter="eagle3", head=tmp_path, backend="torch"),
                   facts()).drafters == ("eagle3",)


# -- the API and CLI around the spec ---------------------------------------------------


def test_llm_load_keywords_map_onto_the_spec(monkeypatch):
    seen = []
    monkeypatch.setattr(LLM, "from_spec", classmethod(lambda cls, spec: seen.append(spec)))
    LLM.load()
    LLM.load("t", draft_model="d", drafter="draft-model", k=3, dtype="float32", device="cpu",
             max_seq_len=64, ngram_max=4, ngram_min=2, draft_quant="none",
             draft_confidence=0.5, backend="torch", adaptive=False)
    assert seen[0] == LoadSpec()
    assert seen[1] == LoadSpec("t", "d", "draft-model", 3, "torch", "float32", "cpu", 64, 4, 2,
                               "none", 0.5, False)


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["generate", "hi", *argv])


def test_one_argument_definition_gives_the_spec():
    assert cli.load_spec(_parse()) == LoadSpec()
    spec = cli.load_spec(_parse("-m", "t", "-md", "d", "--drafter", "ngram", "-k", "3",
                                "--max-context", "64", "--no-adaptive", "--ngram-max", "4",
                                "--backend", "torch", "--draft-confidence", "0"))
    assert spec == LoadSpec("t", "d", "ngram", 3, "torch", max_seq_len=64, ngram_max=4,
                            draft_confidence=0.0, adaptive=False)
    for command in ("serve", "bench", "advise"):
        args = cli.build_parser().parse_args([command, "-m", "t", "--max-context", "64"])
        assert cli.load_spec(args) == LoadSpec("t", max_seq_len=64)


def test_the_flag_table_names_every_option_and_only_real_flags():
    assert set(cli.LOAD_FLAGS) == {f.name for f in fields(LoadSpec)}
    flags = {s for a in cli.build_parser()._subparsers._group_actions[0].choices[
        "generate"]._actions for s in a.option_strings}
    for name in cli.LOAD_FLAGS.values():
        assert set(name.split("/")) <= flags, name


def test_cli_names_flags_where_the_api_names_parameters():
    e = OptionError("<drafter> 'draft-model' needs a <draft_model>")
    assert str(e) == "drafter 'draft-model' needs a draft_model"
    assert cli.error_line(e) == "specdecode: error: --drafter 'draft-model' needs a --draft-model"
    e = OptionError("<k> 9 does not fit a context of 8 tokens: at most 6; <nothing> stays")
    assert str(e).startswith("k (num_speculative_tokens) 9") and "<nothing> stays" in str(e)
    assert cli.error_line(e).startswith("specdecode: error: -k/--num-speculative-tokens 9")


def test_bench_rows_are_specs():
    base = BenchOptions(target="t", draft_model="d", dtype="float32", ngram_max=4).spec()
    assert base == LoadSpec("t", "d", dtype="float32", ngram_max=4)
    assert Config("specdecode", "auto").spec(base) is base  # the shipped default, as given
    assert Config("specdecode", "plain").spec(base) == replace(base, drafter="none", k=0,
                                                               adaptive=False)
    assert Config("specdecode", "ngram", 16).spec(base) == replace(base, drafter="ngram", k=16,
                                                                   adaptive=False)
    row = resolve(Config("specdecode", "ngram", 16).spec(base), facts())
    assert (row.k, row.ngram_max, row.adaptive) == (16, 4, False)
    # head is bench-wide (--head) but reaches only the head rows (test_bench)
    assert BenchOptions.load_fields(base) == {f.name: getattr(base, f.name) for f in
                                              fields(LoadSpec) if f.name not in
                                              ("drafter", "k", "adaptive")}


# -- building a plan (tiny random models, torch) -----------------------------------------


def _tokenizer(vocab_size: int) -> SimpleNamespace:
    return SimpleNamespace(eos_token_ids=(), vocab_size=vocab_size,
                           hf=SimpleNamespace(get_vocab=lambda: {"a": 0}))


@pytest.fixture
def models() -> LoadedModels:
    target, draft = tiny(seed=1), tiny(seed=2)
    tok = _tokenizer(target.vocab_size)
    return LoadedModels(Loaded(target, tok, Path("/m/t.gguf"), 0.0, False),
                        Loaded(draft, tok, Path("/m/d.gguf"), 0.0, False),
                        LoadInfo(target="/m/t.gguf", draft="/m/d.gguf (float32)"),
                        (Path("/m/t.gguf"), Path("/m/d.gguf")))


STEEP, FLAT = CostModel({1: 1.0, 8: 4.0, 65: 20.0}), CostModel({1: 1.0, 8: 1.1, 65: 2.0})


def test_build_fixed_plans_share_the_draft_model_drafter(models):
    a = LLM.build(plan(adaptive=False), models)
    b = LLM.build(plan(adaptive=False, k=2), models)
    assert isinstance(a.drafter, DraftModelDrafter) and a.drafter is b.drafter
    assert (a.k, b.k, a.info.drafter, a.decoder.controller) == (8, 2, "draft-model", None)
    ngram = LLM.build(plan(drafter="ngram", adaptive=False), models)
    assert isinstance(ngram.drafter, NgramDrafter) and ngram.drafter.max_n == 3
    plain = LLM.build(plan(drafter="none", k=0), models)
    assert not plain.speculative and plain.info is not a.info


def _fixed_default(built: LLM) -> bool:
    """Whether an LLM runs the fixed-k default: one drafter under the collapse guard."""
    slots = built.decoder.controller.slots
    return len(slots) == 1 and not slots[0].prices_catchup


def test_build_settles_the_default_from_the_curve(models, monkeypatch):
    measured, machine = [], {}

    def measure(target, drafter, info, k, files):
        measured.append((drafter, k))
        return machine["curve"]

    monkeypatch.setattr(llm_module, "measured_costs", measure)
    monkeypatch.setattr(llm_module, "cached_prior", lambda *a: machine["cached"])
    for curve, adaptive in ((STEEP, True), (FLAT, False)):  # llama.cpp measures at load
        machine["curve"] = curve
        built = LLM.build(plan(drafter="ngram"), models)
        assert _fixed_default(built) is not adaptive  # fixed k under the collapse guard
        assert built.k == (64 if adaptive else 16)
        assert ("adaptive by default" if adaptive else "fixed k by default") in built.info.choice
    assert measured == [(None, 64), (None, 64)]  # once each: the prior is reused
    torch_plan = plan(drafter="ngram", backend="torch")
    for cached, adaptive in ((None, False), (FLAT, False), (STEEP, True)):  # cache only
        machine["cached"] = cached
        built = LLM.build(torch_plan, models)
        assert _fixed_default(built) is not adaptive
        assert ("fixed k by default" in built.info.choice) is (cached is FLAT)
    assert len(measured) == 2  # torch measured nothing


def test_build_adaptive_auto_chooses_and_keeps_the_draft(models, monkeypatch):
    monkeypatch.setattr(llm_module, "measured_costs", lambda *a: STEEP)
    built = LLM.build(plan(adaptive=True), models)
    assert built.info.drafter == "ngram+suffix+draft-model"
    assert "n-gram and suffix lookup + the draft model" in built.info.choice
    assert "each step's drafter and length" in built.info.choice


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this torch has CUDA")
def test_a_device_this_torch_lacks_is_an_option_error_before_loading():
    """LLM.load names the option (it once raised torch's AssertionError mid-load)."""
    with pytest.raises(OptionError) as e:
        llm_module.LLM.load("smollm2-135m", device="cuda")
    assert e.value.param == "device" and "no CUDA device" in str(e.value)
    with pytest.raises(OptionError) as e:
        llm_module.LLM.load("smollm2-135m", device="banana")
    assert e.value.param == "device"


def test_a_context_too_small_for_a_step_is_refused_before_loading():
    """--max-context 1 once failed inside the cost-curve measurement ("last_n=1 must be
    in 0..0")."""
    with pytest.raises(OptionError, match="at least 16 tokens") as e:
        llm_module.LLM.load("smollm2-135m", max_seq_len=15)
    assert e.value.param == "max_seq_len"
