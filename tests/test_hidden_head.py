"""The final-hidden-state head: its data, training and drafter (drafters/hidden_head.py,
train/). Float32 exactness on tiny random targets; the end-to-end run on SmolLM2-135M."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import plain_greedy, tiny
from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.drafters.base import DraftContext, TargetOutput
from specdecode.drafters.hidden_head import HiddenHeadDrafter, HiddenStateHead
from specdecode.models import ModelConfig, Transformer
from specdecode.models.base import FINAL_LAYER
from specdecode.train import data, fit
from specdecode.verify import SamplingVerifier
from test_distribution import V, always_accept, chi_square_pvalue, exact_joint, sample_joint


def head_for(target: Transformer, vocab: int | None = None, seed: int = 0) -> HiddenStateHead:
    """An untrained head (random MLP, lm_head from the target) over `vocab` draft ids."""
    torch.manual_seed(seed)
    v = target.config.vocab_size
    d2t = torch.arange(v)[: vocab or v]
    head = fit.new_head(target.embed_tokens.weight, target.lm_head.weight, d2t)
    with torch.no_grad():  # not the identity init: drafts that differ from the target's
        for p in (head.fc.weight, head.down.weight):
            p.normal_(0, 0.2)
    return head.eval()


class Recorder(HiddenHeadDrafter):
    """Keeps (context length, the target state it was given) at each proposal."""

    def __init__(self, head):
        super().__init__(head)
        self.seen = []

    def propose(self, ctx):
        if ctx.target is not None:
            self.seen.append((len(ctx.tokens), ctx.target.hidden[FINAL_LAYER][-1].clone()))
        return super().propose(ctx)


def test_data_rows_are_the_states_the_drafter_is_given():
    """Shard row j (the state that scored answer token a_j) is the state the engine
    hands a drafter when a_j is the pending token; the first step gets the prefill's."""
    target = tiny(1)
    prompt = [3, 14, 15, 92, 65]
    tokens, hidden = data.answer_with_states(target, prompt, 12, ())
    assert tokens.tolist() == plain_greedy(target, prompt, 12)
    rec = Recorder(head_for(target))
    SpeculativeDecoder(target, rec, 3).generate(
        prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert rec.seen and rec.seen[0][0] == len(prompt)  # the first step has a state
    for length, state in rec.seen[1:]:
        j = length - len(prompt) - 1  # the pending token is a_j
        assert torch.allclose(state, hidden[j], atol=1e-5), j


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_identity_float32(k):
    target = tiny(2)
    prompt = [5, 9, 2, 6, 5, 3]
    want = plain_greedy(target, prompt, 40)
    for vocab in (None, 40):  # full and reduced draft vocabulary
        drafter = HiddenHeadDrafter(head_for(target, vocab))
        out = SpeculativeDecoder(target, drafter, k).generate(
            prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        assert out.token_ids == want
        assert out.stats.drafted > 0


def test_unrolled_training_logits_are_the_drafting_logits():
    """Training's step d at window i equals the drafter's step d when the drafted
    tokens are the window's tokens (the head's own greedy chain)."""
    target = tiny(3)
    head = head_for(target, 50)
    h = torch.randn(1, target.config.hidden_size)
    drafter = HiddenHeadDrafter(head)
    ctx = DraftContext([7, 8, 9], 4, target=TargetOutput(torch.zeros(1, 1), {FINAL_LAYER: h}))
    drafted = drafter.propose(ctx).tokens
    window = torch.cat((torch.tensor([9]), drafted))[None]  # [1, 5]
    logits = fit.unrolled_logits(head, h, window)
    assert [int(head.d2t[x.argmax()]) for x in logits] == drafted.tolist()


def test_windows_and_vocabulary():
    shard = (torch.tensor([4, 4, 7, 2]), torch.randn(4, 3))
    w = fit.Windows.of([shard], depths=2)
    assert w.tokens.tolist() == [[4, 4, 7], [4, 7, 2], [7, 2, -1]]
    assert torch.equal(w.hidden, shard[1][:3])
    # 9 always; then 4 (twice); 7 and 2 tie (once each): the lower id
    assert fit.draft_vocabulary([shard], 3, 10, always=(9,)).tolist() == [2, 4, 9]


def test_fit_keeps_to_its_time_budget_and_trains_under_bf16_autocast():
    """minutes: `steps` is cut to what fits, from step 3 on (a budget no step fits:
    the minimum of 4), the schedule and the evaluations after the cut follow; bf16
    autocast keeps float32 weights; the curve counts the answer tokens seen."""
    target = tiny(2)
    tokens, hidden = data.answer_with_states(target, [3, 1, 4, 1, 5], 24, ())
    windows = fit.Windows.of([(tokens, hidden)], depths=2)
    head = head_for(target)
    result = fit.fit(head, windows, windows, steps=1000, batch=8, minutes=1e-9, evals=2,
                     autocast=torch.bfloat16)
    assert result.steps == 4 and [p["step"] for p in result.curve] == [4]
    assert result.curve[-1]["tokens"] == 4 * 8
    assert all(p.dtype == torch.float32 for p in head.parameters())


def test_step_plan_follows_the_pace_after_a_slow_start(monkeypatch):
    """Three slow first steps (10 s each) do not set the plan: from step 3 on it
    follows the pace since step 3 (1 s a step) and fills the 60 s budget; the
    evaluations fall at even fractions of the plan as it stands."""
    clock = [0.0]
    monkeypatch.setattr(fit.time, "perf_counter", lambda: clock[0])
    plan = fit.StepPlan(1000, 1.0, evals=2)
    step, evals = 0, []
    while step < plan.total:
        step += 1
        clock[0] += 10.0 if step <= 3 else 1.0
        plan.after(step)
        if plan.eval_due(step):
            evals.append(step)
    assert step == 3 + 30 and plan.total == 33
    assert evals == [17, 33]
    assert fit.StepPlan(50, None, evals=5).total == 50
    unasked = fit.StepPlan(4, None, evals=0)  # no evaluations asked: the final one still
    assert [s for s in range(1, 5) if unasked.eval_due(s)] == [4]


def test_training_sets_only():
    with pytest.raises(ValueError, match="humaneval"):
        data.training_prompts(["gsm8k", "humaneval"])


def test_training_sets_interleave_past_the_shortest(tmp_path):
    """One of each set in turn; a set that runs out drops out, the rest go on."""
    for name, n in (("gsm8k", 3), ("swe-bench", 1), ("arena-hard-v2", 2)):
        lines = [json.dumps({"turns": [f"{name}{i}", "second"]}) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    sets = ["gsm8k", "swe-bench", "arena-hard-v2"]
    assert data.training_prompts(sets, folder=tmp_path) == [
        "gsm8k0", "swe-bench0", "arena-hard-v20", "gsm8k1", "arena-hard-v21", "gsm8k2"]
    assert data.training_prompts(sets, folder=tmp_path, limit=4)[-1] == "gsm8k1"


def small_target(seed: int) -> Transformer:
    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=64)
    return Transformer.random(cfg, seed=seed, logit_scale=3.0)


@pytest.mark.slow
def test_sampling_preserves_the_target_distribution():
    """Chi-square on the first two tokens at T = 1 with the head's q (k = 3); the
    broken always-accept verifier fails the same test (negative control)."""
    target = small_target(4)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_joint(target, params)
    good = SpeculativeDecoder(target, HiddenHeadDrafter(head_for(target)), 3)
    assert chi_square_pvalue(sample_joint(good, params, 4000), exact) > 1e-3

    def broken(params, key, generator):
        return SamplingVerifier(params, key, generator, rejection=always_accept)
    bad = SpeculativeDecoder(target, HiddenHeadDrafter(head_for(target)), 3, verifier=broken)
    assert chi_square_pvalue(sample_joint(bad, params, 2000), exact) < 1e-6


@pytest.mark.slow
def test_end_to_end_on_smollm2(tmp_path):
    """Collect (resumable), train, save, load, draft: the trained head's held-out
    acceptance beats the untrained head's clearly; greedy output is plain's."""
    import real
    loaded = real.load("smollm2-135m")
    target, tok = loaded.model, loaded.tokenizer
    encode = lambda p: tok.chat([{"role": "user", "content": p}])  # noqa: E731
    stops = target.config.eos_token_ids
    train_paths = data.collect(target, encode, data.docstring_prompts(16), tmp_path / "train",
                               max_new_tokens=32, stop_ids=stops, progress=False)
    assert data.collect(target, encode, data.docstring_prompts(16), tmp_path / "train",
                        max_new_tokens=32, progress=False) == train_paths  # resumed: no work
    val_paths = data.collect(target, encode, data.docstring_prompts(6, skip=60),
                             tmp_path / "val", max_new_tokens=32, stop_ids=stops,
                             progress=False)
    train, val = data.load_shards(train_paths), data.load_shards(val_paths)
    d2t = fit.draft_vocabulary(train, 2048, target.config.vocab_size, always=stops)
    head = fit.new_head(target.embed_tokens.weight, target.lm_head.weight, d2t)
    wt, wv = fit.Windows.of(train, 3), fit.Windows.of(val, 3)
    untrained = fit.acceptance(head, wv)
    result = fit.fit(head, wt, wv, steps=200, batch=128, lr=2e-3, evals=2)
    trained = result.curve[-1]["accept"]
    assert trained[0] > untrained[0] + 0.15 and result.tau > 1 + sum(untrained) + 0.2
    back = HiddenStateHead.load(head.save(tmp_path / "head"), target.embed_tokens.weight)
    assert fit.acceptance(back, wv) == trained
    prompt = encode(data.docstring_prompts(1, skip=80)[0])
    want = plain_greedy(target, prompt, 40)
    out = SpeculativeDecoder(target, HiddenHeadDrafter(back), 3).generate(
        prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert out.token_ids == want and out.stats.accepted > 0
    check_loaded_by_name(tmp_path / "head", want, prompt)


def check_loaded_by_name(head_dir, want: list[int], prompt: list[int]) -> None:
    """LLM.load(..., drafter="hidden-head", head=...) on both backends: torch float32
    drafts plain's tokens; llama.cpp (its own kernels: another rounding) drafts, and
    its output is compared with its own plain decoding."""
    from specdecode.llm import LLM
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm = LLM.load("smollm2-135m", drafter="hidden-head", head=str(head_dir), k=3,
                   dtype="float32", backend="torch", adaptive=False)
    out = llm.decoder.generate(prompt, params)
    assert out.token_ids == want and out.stats.accepted > 0
    fast = LLM.load("smollm2-135m", drafter="hidden-head", head=str(head_dir), k=3,
                    backend="llama.cpp", adaptive=False)
    spec = fast.decoder.generate(prompt, params)
    plain = SpeculativeDecoder(fast.decoder.target, None).generate(prompt, params)
    assert spec.stats.accepted > 0 and spec.token_ids == plain.token_ids


def test_head_options_are_checked(tmp_path):
    from specdecode.options import LoadSpec, OptionError
    from specdecode.plan import Facts, resolve
    with pytest.raises(OptionError, match="no trained head"):
        LoadSpec(drafter="hidden-head", head=tmp_path)
    with pytest.raises(OptionError, match="needs a head"):
        resolve(LoadSpec("smollm2-135m", drafter="hidden-head"), Facts.here())
