"""Bench arithmetic, summaries of scripted runs, workload parsing (no real models)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import OracleDrafter, plain_greedy
from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.bench import metrics, workloads
from specdecode.bench.advise import _recommend
from specdecode.bench.runner import Config
from specdecode.bench.summary import summarise


def test_leviathan_expected_tokens_and_speedup():
    assert metrics.expected_tokens_per_step(0.5, 3) == pytest.approx((1 - 0.5**4) / 0.5)
    assert metrics.expected_tokens_per_step(1.0, 4) == 5.0
    assert metrics.expected_tokens_per_step(0.8, 0) == 1.0
    # alpha 0.8, k 4: 3.3616 tokens per step; cost 4 * 0.1 + 1.5 = 1.9 plain steps
    assert metrics.theoretical_speedup(0.8, 4, 0.1, 1.5) == pytest.approx(3.3616 / 1.9)


def test_expected_tokens_from_positions_reuses_the_last_value():
    assert metrics.expected_tokens_from_positions([1.0, 0.5], 3) == pytest.approx(2.75)
    assert metrics.expected_tokens_from_positions([], 4) == 1.0


def test_replay_speedup_and_cost_interpolation():
    curve = {1: 1.0, 3: 1.4, 5: 2.2}
    assert metrics.interpolate(curve, 2) == pytest.approx(1.2)
    assert metrics.interpolate(curve, 7) == pytest.approx(3.0)  # extrapolated
    # two steps measured at k=4: 4 drafted/4 accepted, 4 drafted/0 accepted
    # at k=2: tokens (2+1)+(0+1)=4, cost 2*(2*0.1+1.4)=3.2
    assert metrics.replay_speedup([4, 4], [4, 0], 2, 0.1, curve) == pytest.approx(4 / 3.2)
    # at k=4: tokens 5+1=6, cost 2*(0.4+2.2)=5.2
    assert metrics.replay_speedup([4, 4], [4, 0], 4, 0.1, curve) == pytest.approx(6 / 5.2)


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_divergence([1, 2, 3], [1, 2]) == 2


def _row(prompt, config: Config, tps, token_ids, stats=None, temperature=0.0):
    row = {"workload": "w", "prompt": prompt, "temperature": temperature, "repeat": 0,
           "config": config.label, "engine": config.engine, "method": config.method,
           "k": config.k, "tokens_per_second": tps, "token_ids": token_ids}
    if stats is not None:
        row["stats"] = {**stats.to_dict(), "position_tried": stats.position_tried,
                        "position_accepted": stats.position_accepted}
    return row


def _scripted(target, prompt, truth, script):
    """The first len(script) steps of a k=4 run whose drafter gets script[i] tokens right."""
    decoder = SpeculativeDecoder(target, OracleDrafter(prompt + truth, target.vocab_size,
                                                       script), 4)
    ids = []
    for step, event in enumerate(decoder.stream(prompt, SamplingParams(max_tokens=len(truth),
                                                                       ignore_eos=True))):
        ids += event.token_ids
        if step + 1 == len(script):
            return SimpleNamespace(token_ids=ids, stats=event.stats)


def test_summary_of_scripted_runs_gives_known_metrics(target):
    """Two prompts, scripted acceptance: merged acceptance, tau, per-position values,
    paired speedups, costs and exact match follow from the script alone."""
    plain_cfg, spec_cfg = Config("specdecode", "plain"), Config("specdecode", "draft-model", 4)
    rows = []
    for name, prompt, script, tps in (("a", [3, 141, 59], [4, 2, 0], 20.0),
                                      ("b", [26, 53, 58, 97], [1, 3], 30.0)):
        n = sum(a + 1 for a in script)
        truth = plain_greedy(target, prompt, n + 8)
        plain = SpeculativeDecoder(target, None).generate(
            prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        spec = _scripted(target, prompt, truth, script)
        assert spec.stats.accepted_per_step == script
        rows.append(_row(name, plain_cfg, 10.0, plain.token_ids, plain.stats))
        row = _row(name, spec_cfg, tps, spec.token_ids, spec.stats)
        row["divergence"] = None if spec.token_ids == plain.token_ids else {"index": 0}
        rows.append(row)
    [p, s] = summarise(rows, [plain_cfg, spec_cfg])
    assert p["config"] == "specdecode plain" and p["mean_accepted_length"] == 1.0
    assert s["speedup"] == pytest.approx(2.5)  # median of the paired 2.0x and 3.0x
    assert s["acceptance_rate"] == pytest.approx(10 / 20)  # 5 steps x k=4 drafted
    assert s["mean_accepted_length"] == pytest.approx(15 / 5)
    # position 1 tried 5x accepted 4x; position 2: 4/3; 3: 3/2 (script 4,2,0,1,3)
    assert s["position_acceptance"] == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1 / 2])
    assert s["k_eff"] == pytest.approx(4.0)
    assert s["exact_match"] == (2, 2) and s["divergences"] == []
    assert s["c_verify"] > 0 and s["theoretical_speedup"] > 0
    assert s["theoretical_speedup"] == pytest.approx(metrics.theoretical_speedup(
        0.5, 4.0, s["c_draft"], s["c_verify"]))


def test_recommendation_says_when_speculation_does_not_pay():
    best = {"drafter": "draft-model", "best_k": 2, "best_speedup": 0.8, "measured_k": 8,
            "acceptance_rate": 0.3, "mean_accepted_length": 1.3}
    advice = _recommend(best)
    assert advice["drafter"] == "none" and "does not pay" in advice["text"]
    assert "20% slower" in advice["text"]
    advice = _recommend(dict(best, best_speedup=1.6))
    assert advice["drafter"] == "draft-model" and advice["k"] == 2
    assert "-k 2" in advice["text"]


def test_named_workloads():
    assert len(workloads.load("chat")) == 5
    assert len(workloads.load("code-edit", limit=1)) == 1
    assert len(workloads.load("chat:2", limit=4)) == 2  # a per-workload count wins
    randoms = workloads.load("random", limit=2)
    assert [p.name for p in randoms] == ["random-0", "random-1"]
    assert randoms[0].messages != randoms[1].messages
    assert randoms[0] == workloads.load("random", limit=1)[0]  # seeded


def test_jsonl_workload(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps(
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hi"}], "name": "second"}) + "\n")
    prompts = workloads.load(str(path))
    assert [p.workload for p in prompts] == ["mine", "mine"]
    assert prompts[0].messages == ({"role": "user", "content": "hello"},)
    assert prompts[1].name == "second" and len(prompts[1].messages) == 2
    assert len(workloads.load(str(path), limit=1)) == 1


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\nnot json\n', "mine.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n', 'expected an object with "prompt" or "messages"'),
    ('{"prompt": "a", "messages": []}\n', "exactly one of them"),
    ('{"prompt": ""}\n', '"prompt" must be a non-empty string'),
    ('{"messages": [{"role": "user"}]}\n', '"messages" must be a non-empty list'),
    ("\n\n", "has no prompts"),
])
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "mine.jsonl"
    path.write_text(content)
    with pytest.raises(workloads.WorkloadError, match=message.replace("(", r"\(")):
        workloads.load(str(path))


def test_unknown_workload_and_missing_file(tmp_path):
    with pytest.raises(workloads.WorkloadError, match="unknown workload 'poetry'"):
        workloads.load("poetry")
    with pytest.raises(workloads.WorkloadError, match="not found"):
        workloads.load(str(tmp_path / "missing.jsonl"))


def test_measuring_sets_as_workloads():
    """mt-bench and mbpp: the first turns of the shared measuring sets, in file order."""
    from specdecode.bench.agent import MT_BENCH
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    mt = workloads.load("mt-bench:3")
    assert [p.messages[0]["content"] for p in mt] == [r["turns"][0] for r in rows[:3]]
    assert [p.name for p in workloads.load("mbpp", limit=2)] == ["mbpp-0", "mbpp-1"]


def test_head_rows_carry_the_head_and_other_rows_do_not(tmp_path):
    """bench --head: the eagle3 / hidden-head rows run it at each -k; plain, the draft
    model and the shipped default are loaded without it (a head with another drafter
    is refused by the plan)."""
    from specdecode.bench.runner import BenchOptions, specdecode_configs
    (tmp_path / "config.json").write_text("{}")
    options = BenchOptions(drafters=["auto", "draft-model", "eagle3"], draft_k=[2, 4],
                           head=str(tmp_path))
    configs = specdecode_configs(options, has_draft=True)
    labels = [c.label for c in configs]
    assert "specdecode eagle3 k=2" in labels and "specdecode eagle3 k=4" in labels
    base = options.spec()
    for c in configs:
        spec = c.spec(base)
        assert spec.head == (str(tmp_path) if c.method == "eagle3" else None), c.label
