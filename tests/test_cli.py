"""CLI: bad input exits non-zero with one line on stderr and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import real


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args, needles", [
    (["generate", "hi", "--target", "/no/such/model.gguf"], ["no such model file"]),
    (["generate", "hi", "--target", "no-such-model"], ["unknown model 'no-such-model'"]),
    (["generate", "hi", "-k", "-1"], ["-k", "must be >= 0"]),
    (["generate", "hi", "--temperature", "-0.5"], ["temperature must be >= 0"]),
    (["generate", "hi", "--max-tokens", "lots"], ["--max-tokens", "invalid int value"]),
    (["generate", "hi", "--top-p", "2"], ["top_p must be in (0, 1]"]),
    (["generate", "hi", "--drafter", "magic"], ["invalid choice: 'magic'"]),
    (["generate"], ["give a PROMPT or --messages FILE"]),
    (["generate", "--messages", "/no/such.json"], ["no such messages file"]),
    (["pull", "nothing-like-this"], ["unknown model 'nothing-like-this'"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
])
def test_bad_input_is_one_clean_line(args, needles):
    assert_clean_error(run(*args), *needles)


def test_bad_messages_json(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    assert_clean_error(run("generate", "--messages", str(bad)), "not valid JSON")
    bad.write_text(json.dumps({"role": "user"}))
    assert_clean_error(run("generate", "--messages", str(bad)), "non-empty list")


def test_generate_json_on_a_real_model_with_compare_plain(tmp_path):
    real.path("smollm2-135m")
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Count from 1 to 10."}]))
    proc = run("generate", "--messages", str(messages), "--target", "smollm2-135m",
               "--drafter", "ngram", "-k", "3", "--max-tokens", "24", "--dtype", "float32",
               "--compare-plain", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["identical_to_plain"] is True
    assert out["completion_tokens"] == len(out["token_ids"]) <= 24
    assert out["finish_reason"] in ("stop", "length")
    assert set(out["stats"]) >= {"acceptance_rate", "mean_accepted_length", "drafted",
                                 "accepted", "position_acceptance"}


def test_generate_human_output_streams_text_and_stats():
    real.path("smollm2-135m")
    proc = run("generate", "def add(a, b):", "--target", "smollm2-135m", "--drafter", "ngram",
               "--max-tokens", "16", "--dtype", "float32", "--stop", "\n\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "acceptance rate" in proc.stderr and "tokens/s" in proc.stderr


@pytest.mark.slow
def test_draft_model_with_another_vocabulary_is_refused():
    real.path("smollm2-135m")
    real.path("qwen2.5-coder-0.5b")
    proc = run("generate", "hi", "--target", "smollm2-135m", "--draft-model",
               "qwen2.5-coder-0.5b", "--max-tokens", "4")
    assert_clean_error(proc, "vocabulary", "does not match")
