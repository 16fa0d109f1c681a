"""A GGUF header is parsed once per version of the file (models/gguf_meta.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import real
from specdecode.models import gguf_meta, loading
from specdecode.models.loading import UnsupportedModel


@pytest.fixture(scope="module")
def smol():
    """The real file, found before any test points the cache elsewhere."""
    return real.path("smollm2-135m")


@pytest.fixture
def parses(monkeypatch, tmp_path, smol):
    """A fresh cache folder and process memo; counts the header parses."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_meta, "_parsed", {})
    count, real_open = [], loading.open_gguf

    def counting_open(path):
        count.append(path)
        return real_open(path)

    monkeypatch.setattr(loading, "open_gguf", counting_open)
    return count


def test_parsed_once_then_read_back_in_a_new_process(parses, tmp_path, monkeypatch, smol):
    path = tmp_path / "smol.gguf"
    shutil.copyfile(smol, path)
    first = loading.read_config(path)
    assert first.vocab_size == 49152 and first.eos_token_ids == (2,) and len(parses) == 1
    with monkeypatch.context() as m:  # the process memo answers, not the file
        m.setattr(gguf_meta, "_read_saved", lambda key: pytest.fail("read the file"))
        assert loading.read_config(path) == first and len(parses) == 1
    monkeypatch.setattr(gguf_meta, "_parsed", {})  # what a new process starts with
    assert loading.read_config(path) == first and len(parses) == 1
    assert first == loading.gguf_config(loading.open_gguf(path))  # the parse itself
    assert len(list((tmp_path / "cache" / "configs").glob("*.json"))) == 1


def test_a_changed_file_is_parsed_again(parses, tmp_path, smol):
    path = tmp_path / "smol.gguf"
    shutil.copyfile(smol, path)
    loading.read_config(path)
    with path.open("ab") as f:
        f.write(b"\0" * 64)  # a new version: another size
    assert loading.read_config(path).num_layers == 30 and len(parses) == 2


def test_a_corrupt_file_is_not_remembered(parses, tmp_path, smol):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smol.read_bytes()[:5_000_000])
    for _ in range(2):
        with pytest.raises(UnsupportedModel, match="truncated"):
            loading.read_config(cut)
    assert len(parses) == 2 and not (tmp_path / "cache" / "configs").exists()


def test_pull_reads_the_header_so_the_first_load_does_not(smol, tmp_path):
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / smol.name).symlink_to(smol)  # pulled already: no download here
    env = {**os.environ, "SPECDECODE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", "pull", "smollm2-135m"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == str(models / smol.name), proc.stderr
    assert len(list((tmp_path / "cache" / "configs").glob("*.json"))) == 1
