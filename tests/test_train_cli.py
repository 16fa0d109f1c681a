"""`specdecode train` as a user runs it: the command end to end on a real small target,
its shards under $SPECDECODE_CACHE, its head usable by `generate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import real


def run(*args: str, cache) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECDECODE_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "specdecode.cli", *args], capture_output=True,
                          text=True, errors="replace", timeout=900, env=env)


@pytest.mark.slow  # about 1-3 minutes: a real target answers, trains, then generates
def test_train_writes_a_head_a_summary_and_its_shards_in_the_cache(tmp_path):
    model = str(real.path("smollm2-135m"))
    cache, out = tmp_path / "cache", tmp_path / "head"
    done = run("train", "--target", model, "--backend", "torch", "--dtype", "float32",
               "--out", str(out), "--prompts", "6", "--val-prompts", "2",
               "--max-new-tokens", "12", "--steps", "6", "--batch", "16",
               "--draft-vocab", "512", cache=cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    summary = json.loads(done.stdout)
    assert summary["drafter"] == "hidden-head" and summary["steps"] == 6
    assert summary["prompts"] == 6 and summary["validation_prompts"] == 2
    assert summary["train_windows"] > 0 and summary["train_tokens"] > 0
    assert (out / "summary.json").is_file() and (out / "curve.png").stat().st_size > 0
    shards = list((cache / "train").glob("*-torch/greedy/*.safetensors"))
    assert len(shards) == 6  # one answer per prompt, validation included
    assert f"--drafter hidden-head --head {out}" in done.stderr
    used = run("generate", "def add(a, b):", "--target", model, "--backend", "torch",
               "--dtype", "float32", "--drafter", "hidden-head", "--head", str(out),
               "--max-tokens", "8", "--temperature", "0", cache=cache)
    assert used.returncode == 0, used.stderr[-2000:]
    assert used.stdout.strip()
