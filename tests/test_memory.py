"""The memory plan (memory.py): parts add up, a load that cannot fit is refused before
anything is read, with a message naming what to change; the CLI says so in one line."""

from __future__ import annotations

import pytest

import real
from specdecode import limits, memory
from specdecode.cli import main
from specdecode.models import PRESETS
from specdecode.models import loading as loading_module
from specdecode.options import LoadSpec, OptionError

GIB = 1 << 30


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kw):
        raise AssertionError("weights were loaded before the memory was checked")

    monkeypatch.setattr(loading_module, "load", refuse)


def _small_memory(monkeypatch, size: int) -> None:
    monkeypatch.setattr(limits, "available_bytes", lambda: size)


def test_the_parts_add_up_and_grow_with_the_context():
    path = str(real.path("smollm2-135m"))
    small = memory.memory_plan(LoadSpec(path, backend="torch", drafter="ngram",
                                        max_seq_len=512, dtype="float32"))
    big = memory.memory_plan(LoadSpec(path, backend="torch", drafter="ngram",
                                      max_seq_len=8192, dtype="float32"))
    names = [p.name for p in small.parts]
    assert names[:2] == ["target weights", "target KV cache (512 tokens)"]
    assert small.total == sum(p.bytes for p in small.parts if p.kind != "process")
    assert small.predicted_peak == small.total + small.parts[-1].bytes
    cfg = limits.model_config(real.path("smollm2-135m"))
    kv = {p.name: p.bytes for p in big.parts}["target KV cache (8192 tokens)"]
    assert kv == limits.kv_cache_bytes(cfg, 8192, 4)
    assert big.total > small.total and big.to_dict()["parts"]["target weights"] > 0


def test_int8_draft_weights_are_about_a_quarter_of_float32():
    cfg = PRESETS["qwen2.5-1.5b"]
    full = limits.weight_bytes(cfg, 4)
    assert 0.25 * full < memory.int8_weight_bytes(cfg, 2) < 0.45 * full


def test_a_load_that_cannot_fit_is_refused_naming_what_to_change(monkeypatch, no_loading):
    path = str(real.path("smollm2-135m"))
    _small_memory(monkeypatch, 64 << 20)
    plan = memory.memory_plan(LoadSpec(path, backend="torch", drafter="ngram",
                                       max_seq_len=8192, dtype="float32"))
    assert not plan.fits
    with pytest.raises(OptionError) as e:
        plan.check()
    text = str(e.value)
    assert "needs about" in text and "target weights" in text and "KV cache" in text
    assert "max_seq_len" in text and "dtype" in text
    from specdecode.llm import LLM

    with pytest.raises(ValueError, match="needs about"):
        LLM.load(path, backend="torch", drafter="ngram", max_seq_len=8192, dtype="float32")


def test_cli_exits_2_with_one_line_when_the_context_cannot_fit(monkeypatch, capsys,
                                                              no_loading):
    path = str(real.path("smollm2-135m"))
    _small_memory(monkeypatch, 64 << 20)
    code = main(["generate", "hi", "--target", path, "--backend", "torch", "--drafter",
                 "ngram", "--max-context", "8192", "--dtype", "float32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--max-context" in err and "needs about" in err


def test_peak_and_resident_bytes_are_read():
    assert memory.peak_resident_bytes() >= memory.resident_bytes() > 0


def test_two_loads_held_at_once_add_up_with_one_process():
    path = str(real.path("smollm2-135m"))
    one = memory.memory_plan(LoadSpec(path, backend="torch", drafter="ngram", max_seq_len=512))
    both = one.plus(one, "auto")
    assert both.total == 2 * one.total
    assert both.predicted_peak == one.predicted_peak + one.total


def test_an_eagle3_head_counts_its_files_and_its_kv_cache(tmp_path):
    """A head's weights (its files) and its one layer's keys and values at the context,
    in the target's dtype, from its config (ours; speculators' the same)."""
    import json

    from specdecode.drafters.eagle import FORMAT
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"format": FORMAT, "num_kv_heads": 3,
                                                  "head_dim": 64}))
    (head / "model.safetensors").write_bytes(b"x" * 1000)
    path = str(real.path("smollm2-135m"))
    plan = memory.memory_plan(LoadSpec(path, backend="torch", drafter="eagle3", head=head,
                                       max_seq_len=1024, dtype="bfloat16"))
    parts = {p.name: p.bytes for p in plan.parts}
    assert parts["head KV cache (1024 tokens)"] == 2 * 3 * 64 * 1024 * 2
    assert parts["head weights"] == 1000 + len((head / "config.json").read_bytes())


@pytest.mark.parametrize("copy", ["0", "1"])
def test_llama_cpp_plain_layout_copy_is_planned_where_it_will_be_loaded(monkeypatch, copy):
    """models/llama_cpp_prefill.py: forced on, the plan counts the copy's mapped weights
    (the file again), KV cache and compute buffer; forced off, nothing of it."""
    monkeypatch.setenv("SPECDECODE_PREFILL_COPY", copy)
    path = real.path("smollm2-135m")
    plan = memory.memory_plan(LoadSpec(str(path), backend="llama.cpp", drafter="ngram",
                                       max_seq_len=512))
    parts = {p.name: p.bytes for p in plan.parts}
    copied = {n: b for n, b in parts.items() if "plain-layout copy" in n}
    if copy == "0":
        assert not copied
        return
    assert copied["target plain-layout copy: weights (mapped)"] == path.stat().st_size
    assert copied["target plain-layout copy: KV cache and compute buffer"] > \
        parts["target KV cache (512 tokens)"]
    # optional (loaded only where twice it is free): in the peak, not in what must fit
    assert plan.predicted_peak == sum(parts.values())
    assert plan.total == sum(b for n, b in parts.items()
                             if n not in copied and n != "process now")
