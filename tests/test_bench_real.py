"""Bench and advise end to end on a real model (SmolLM2-135M, float32, as target and draft)."""

from __future__ import annotations

import json

import pytest

from specdecode import cli
from specdecode.bench import hf_peer, report
from specdecode.bench.advise import AdviseOptions, advise
from specdecode.bench.runner import Bench, BenchOptions, load_models

SMOL = dict(target="smollm2-135m", draft_model="smollm2-135m", dtype="float32")


def _options(tmp_path, **kw) -> BenchOptions:
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text(json.dumps({"prompt": "List three colours."}) + "\n")
    base = dict(SMOL, workloads=["chat", str(jsonl)], limit=1, max_tokens=12,
                draft_k=[2, 4], ngram_k=[4], temperatures=[0.0, 0.7], peers=[])
    return BenchOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_models(_options(tmp_path_factory.mktemp("opts")))


def test_bench_smoke_writes_json_markdown_and_plots(models, tmp_path):
    result = Bench(_options(tmp_path), models).run(progress=False)
    result = json.loads(json.dumps(result))  # JSON-ready as promised
    assert result["schema"] == "specdecode.bench/1"
    assert result["configs"] == ["specdecode plain", "specdecode auto (shipped default)",
                                 "specdecode draft-model k=2", "specdecode draft-model k=4",
                                 "specdecode ngram k=4"]
    assert len(result["runs"]) == 2 * 2 * 5  # prompts x temperatures x configs
    by = {(e["workload"], e["temperature"], e["config"]): e for e in result["summary"]}
    assert len(by) == 20
    for (_, temperature, config), e in by.items():
        assert e["tokens_per_second"] > 0 and e["speedup"] is not None
        if config == "specdecode plain":
            continue
        if config == "specdecode auto (shipped default)":
            # its draft model is the target itself: a draft token costs a plain step, so
            # the fixed-k default's controller (llm.guarded_controller) drafts nothing
            assert e["acceptance_rate"] is None
            assert temperature != 0 or e["exact_match"] == [1, 1]
            continue
        assert 0.0 <= e["acceptance_rate"] <= 1.0 and e["mean_accepted_length"] >= 1.0
        assert e["c_verify"] > 0 and e["theoretical_speedup"] > 0
        if temperature == 0:
            assert e["exact_match"] == [1, 1], e["divergences"]  # float32 greedy: lossless
    # the target is its own draft model: greedy drafts are all accepted
    assert by[("chat", 0.0, "specdecode draft-model k=4")]["acceptance_rate"] == 1.0
    assert result["memory"]["target"] > 100e6 and result["memory"]["draft"] > 100e6

    paths = report.write(result, tmp_path / "out", command="specdecode bench ...")
    assert json.loads(paths["json"].read_text())["summary"] == result["summary"]
    md = paths["markdown"].read_text()
    assert "| chat | 0 | specdecode draft-model k=4 |" in md and "theoretical" in md
    pngs = [p for k, p in paths.items() if p.suffix == ".png"]
    assert len(pngs) == 3
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_missing_peer_is_skipped_with_a_note(models, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_peer, "available", lambda: False)
    bench = Bench(_options(tmp_path, peers=["hf"], drafters=["ngram"], ngram_k=[4]), models)
    assert not any(c.engine == "hf" for c in bench.configs)
    assert any("not installed" in n for n in bench.notes)


def test_advise_recommends_with_numbers():
    result = advise(AdviseOptions(**SMOL, workloads=["chat"], limit=1, max_tokens=16,
                                  max_draft_k=4, max_ngram_k=6))
    assert result["c_verify"][1] == 1.0 and result["plain_step_seconds"] > 0
    [w] = result["workloads"]
    drafters = {c["drafter"]: c for c in w["candidates"]}
    assert set(drafters) == {"draft-model", "ngram"}
    assert sorted(drafters["draft-model"]["predicted_speedup"]) == [1, 2, 3, 4]
    assert sorted(drafters["ngram"]["predicted_speedup"]) == list(range(1, 7))
    assert drafters["draft-model"]["acceptance_rate"] == 1.0  # self-draft, greedy
    rec = w["recommendation"]
    assert rec["drafter"] in ("draft-model", "ngram", "none") and rec["text"]
    assert result["memory"]["target"] > 0


def test_cli_bench_json(tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli.main(["bench", "--target", "smollm2-135m", "--draft-model", "smollm2-135m",
                     "-w", "chat", "--limit", "1", "-n", "4", "--temperatures", "0",
                     "--drafters", "ngram", "--ngram-k", "3", "--peers", "none",
                     "--dtype", "float32", "--out", str(out), "--no-plots", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["configs"] == ["specdecode plain", "specdecode ngram k=3"]
    assert (tmp_path / "cli.json").exists() and (tmp_path / "cli.md").exists()


@pytest.mark.parametrize("argv, message", [
    (["bench", "-w", "poetry"], "unknown workload 'poetry'"),
    (["bench", "-w", "missing.jsonl"], "workload file not found"),
    (["bench", "-k", "0"], "expected integers >= 1"),
    (["bench", "-k", "four"], "expected integers like 4,8"),
    (["bench", "--temperatures", "-1"], "expected finite numbers >= 0"),
    (["bench", "--drafters", "medusa"], "unknown value 'medusa'"),
    (["bench", "--peers", "vllm"], "unknown value 'vllm'"),
    (["bench", "--temperatures", "0,nan"], "expected finite numbers like 0,0.7"),
    (["advise", "--temperature", "-1"], "--temperature: must be a finite number >= 0"),
    (["advise", "--temperature", "nan"], "--temperature: must be a finite number >= 0"),
    (["bench", "--background-load", "-1"], "--background-load: must be >= 0"),
    (["bench", "--seed", "-3"], "--seed: must be in 0..2**64-1"),
    (["check", "--seed", "x"], "--seed: must be an integer, got 'x'"),
    (["advise", "--max-draft-k", "0"], "must be >= 1"),
])
def test_cli_bad_input_is_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_hf_peers_run_on_the_same_weights(models, tmp_path):
    pytest.importorskip("accelerate")
    options = _options(tmp_path, peers=["hf"], temperatures=[0.0], draft_k=[4])
    bench = Bench(options, models)
    assert [c.label for c in bench.configs if c.engine == "hf"] == [
        "HF plain", "HF assisted", "HF prompt-lookup k=10"]
    result = bench.run(progress=False)
    for e in result["summary"]:
        if e["engine"] == "hf" and e["method"] != "plain":
            assert e["exact_match"] == (1, 1)  # HF's own greedy speculation, float32
            assert e["vs_specdecode_plain"] is not None


def test_agent_trajectories_reuse_their_earlier_turns(tmp_path):
    """The agent workload: each configuration decodes its own three turns; turn 1 runs
    cold, turns 2-3 reuse the conversation so far from the prefix cache; the report has
    the per-turn table. The suffix row's store holds the trajectory's turns."""
    options = BenchOptions(**SMOL, workloads=["agent:1"], max_tokens=8, drafters=["suffix"],
                           ngram_k=[8], temperatures=[0.0], peers=[], warmup=False)
    bench = Bench(options, load_models(options))
    result = json.loads(json.dumps(bench.run(progress=False)))
    rows = result["runs"]
    assert [(r["config"], r["turn"]) for r in rows] == [
        (c, t) for c in ("specdecode plain", "specdecode suffix k=8") for t in (1, 2, 3)]
    for r in rows:
        assert r["prompt"] == f"agent-fnmatch/turn{r['turn']}"
        if r["turn"] == 1:
            assert r["cached_tokens"] == 0
        else:  # the turn before's prompt (+ answer), less the few tokens run again so that
            # the new part has a prefill bucket's length (at most 1/8 of it)
            before = next(p for p in rows if p["config"] == r["config"]
                          and p["turn"] == r["turn"] - 1)
            new = r["prompt_tokens"] - before["prompt_tokens"]
            assert r["cached_tokens"] >= before["prompt_tokens"] - new // 8 - 1
        assert r["ttft_seconds"] is not None and 0 < r["ttft_seconds"] <= r["seconds"]
    plain = [r["token_ids"] for r in rows if r["config"] == "specdecode plain"]
    assert [r["token_ids"] for r in rows if r["config"] != "specdecode plain"] == plain
    assert len(result["turns"]) == 6 and {t["turn"] for t in result["turns"]} == {1, 2, 3}
    [suffix] = bench.models.llms["specdecode suffix k=8"].decoder.drafters
    assert suffix.store.stats()["texts"] == 1  # three turns of one conversation: one text
    paths = report.write(result, tmp_path / "agent", plot=False)
    assert "## Per turn (multi-turn workloads)" in paths["markdown"].read_text()


def test_a_head_row_beside_the_draft_model_reports_the_heads_memory(tmp_path):
    """bench with eagle3 and draft-model rows: the plan holds the draft model and the
    head (its files, its KV cache) and the measured memory the head's own tensors,
    the target's embedding table it reads left out."""
    import real
    from test_eagle import eagle_for
    target = real.load("smollm2-135m").model
    head = eagle_for(target, 512).save(tmp_path / "head")
    options = _options(tmp_path, drafters=["draft-model", "eagle3"], draft_k=[2], ngram_k=[],
                       temperatures=[0.0], head=str(head), backend="torch")
    models = load_models(options)
    parts = models.memory_plan["parts"]
    assert parts["draft weights"] > 100e6
    assert parts["head weights"] == sum(f.stat().st_size for f in head.iterdir())
    assert parts[f"head KV cache ({models.memory_plan['context']} tokens)"] > 0
    fresh = eagle_for(target, 512)
    own = sum(t.numel() * t.element_size() for t in [*fresh.parameters(), *fresh.buffers()])
    assert models.memory["head"] == own  # float32 as saved; the target's embedding not in it
