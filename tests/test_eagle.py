"""The EAGLE-3 head: training's unroll equals drafting, greedy identity in float32,
its cache kept in step across plain steps and prefix-cache turns, the sampled
law (drafters/eagle.py, train/eagle_fit.py)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import plain_greedy, tiny
from specdecode import SamplingParams, SpeculativeDecoder
from specdecode.drafters.eagle import Eagle3Cache, Eagle3Drafter, Eagle3Head, chain, enter
from specdecode.models import Transformer
from specdecode.train import data, eagle_fit
from specdecode.verify import SamplingVerifier


def eagle_for(target: Transformer, vocab: int | None = None, seed: int = 0,
              intermediate: int | None = None) -> Eagle3Head:
    """An untrained head with random weights (lm_head from the target) over `vocab` ids
    (intermediate: its MLP width; None: the target's)."""
    torch.manual_seed(seed)
    v = target.config.vocab_size
    head = eagle_fit.new_head(target.embed_tokens.weight, target.lm_head.weight,
                              torch.arange(v)[: vocab or v], target.config,
                              intermediate=intermediate)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name and name != "lm_head.weight":
                p.normal_(0, 0.3)
    return head.eval()


def test_default_layers():
    from specdecode.drafters.eagle import Eagle3Config
    assert Eagle3Config.default_layers(30) == (1, 14, 26)  # vLLM's 2, 15, 27
    assert Eagle3Config.default_layers(2) == (0, 1)


def test_unroll_mask():
    m = eagle_fit.Layout.of([(4, 0, 0)], 3).mask(2)  # depth 2: depth-0 keys <= a, depth 1 at a
    assert m.shape == (2, 4 + 3 + 2)  # anchors 0, 1; keys of depth 0, 1 (anchors 0..2), 2
    assert m[1].tolist() == [True, True, False, False, False, True, False, False, True]
    m = eagle_fit.Layout.of([(6, 0, 3)], 2).mask(1)  # anchors 3, 4: depth 1's from anchor 3 on
    assert m.tolist() == [[True] * 4 + [False] * 2 + [True, False],
                          [True] * 5 + [False] + [False, True]]
    two = eagle_fit.Layout.of([(3, 0, 0), (2, 5, 1)], 2)  # the second: rows 3, 4, anchor 1
    assert [a.tolist() for a in two.anchors] == [[0, 1, 2, 4], [0, 1]]
    assert two.positions.tolist() == [0, 1, 2, 5, 6]
    assert two.mask(0).tolist() == [[True, False, False, False, False],
                                    [True, True, False, False, False],
                                    [True, True, True, False, False],
                                    [False, False, False, True, True]]  # not window 0's
    assert two.mask(1)[1].tolist() == [True, True, False, False, False, False, True]
    assert eagle_fit.first_anchor(10, 4) == 5 and eagle_fit.first_anchor(3, 4) == 0


@torch.no_grad()
def test_training_unroll_is_incremental_drafting():
    """Depth d's logits at entry p (training, all positions at once) equal the
    drafter's chain step d from anchor p - d, with the window's tokens forced."""
    target = tiny(5)
    head = eagle_for(target, 50)
    t, width = 12, len(head.config.aux_layers) * head.config.hidden_size
    aux, ids, start = torch.randn(t, width), torch.randint(0, 50, (t + 1,)), 7
    depths = 4
    unrolled = eagle_fit.unrolled_logits(head, aux, ids, start, depths)
    first = 5  # anchors from 5 on only: the same logits for them
    kept = eagle_fit.unrolled_logits(head, aux, ids, start, depths, first)
    assert [len(x) for x in kept] == [t - first - d for d in range(depths)]
    for a in range(t - depths):
        cache = Eagle3Cache()
        cache.reset(start)
        enter(head, cache, aux[: a + 1], ids[1: a + 2])
        _, steps = chain(head, cache, depths, None, forced=ids[a + 2: a + 2 + depths].tolist())
        for d in range(depths):
            assert torch.allclose(steps[d], unrolled[d][a], atol=1e-3), (a, d)
            if a >= first:
                assert torch.allclose(steps[d], kept[d][a - first], atol=1e-3), (a, d)


def test_loss_and_acceptance_leave_out_only_unscored_anchors():
    """Sequences.loss and chain_lengths run the unroll from first_anchor on; both
    equal a reference over every anchor (answer at row 9 of 16; a short window
    whose answer starts at once; gradients too)."""
    from specdecode.train.fit import DEPTH_DECAY, target_to_draft
    target = tiny(7)
    head = eagle_for(target, 40)
    t2d = target_to_draft(head.draft_ids, head.config.target_vocab_size)
    torch.manual_seed(3)
    width = head.fc.in_features
    shards = [eagle_fit.Shard(torch.randn(16, width), torch.randint(0, 50, (17,)), 9, 4),
              eagle_fit.Shard(torch.randn(3, width), torch.randint(0, 50, (4,)), 1, 0)]
    with torch.no_grad():  # answer tokens the head's first step drafts: chains of 1+
        s = shards[0]
        for a in range(s.answer_start - 2, 15):
            first_step = eagle_fit.unrolled_logits(head, s.features(), s.ids, s.start, 1)[0]
            s.ids[a + 2] = head.draft_ids[first_step[a].argmax()]
    seqs = eagle_fit.Sequences(shards, 4)
    total, count = torch.zeros(()), 0
    for s in shards:  # reference: every anchor's logits, unscored rows masked by labels
        for d, rows in enumerate(eagle_fit.unrolled_logits(head, s.features(), s.ids, s.start, 4)):
            labels = s.labels(t2d, d)[d:]
            total = total + DEPTH_DECAY ** d * torch.nn.functional.cross_entropy(
                rows, labels, ignore_index=-100, reduction="sum")
            count += int((labels >= 0).sum()) if d == 0 else 0
    want = total / count
    want.backward()
    want_grad = head.fc.weight.grad.clone()
    head.zero_grad()
    got = seqs.loss(head, t2d)
    got.backward()
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(head.fc.weight.grad, want_grad, atol=1e-6)
    with torch.no_grad():
        s = shards[0]
        full = eagle_fit.unrolled_logits(head, s.features(), s.ids, s.start, 4)
        nxt = torch.cat((s.ids[2:], torch.full((4,), -2)))
        ref = []
        for a in range(s.answer_start - 2, 15):
            n = 0
            while n < 4 and a + n < 16 and int(head.draft_ids[full[n][a].argmax()]) == nxt[a + n]:
                n += 1
            ref.append(n)
        assert min(ref) >= 1
        assert seqs.chain_lengths(head)[0].tolist() == ref


def test_windows_unrolled_together_are_the_windows_unrolled_apart():
    """packed_logits of windows of different lengths, starts and first anchors (one
    too short for the deeper steps) is each window's unrolled_logits, in order; the
    batch's loss, soft labels in one window only, is the windows' losses weighted
    by their scored entries (gradients too)."""
    from specdecode.train.fit import target_to_draft
    target = tiny(7)
    head = eagle_for(target, 40)
    t2d = target_to_draft(head.draft_ids, head.config.target_vocab_size)
    torch.manual_seed(5)
    width = head.fc.in_features
    shards = [eagle_fit.Shard(torch.randn(t, width), torch.randint(0, 50, (t + 1,)), a, s)
              for t, a, s in ((16, 9, 4), (3, 1, 0), (11, 2, 30))]
    shards[2].top_ids = torch.randint(0, 50, (11, 4)).int()
    shards[2].top_logp = torch.log_softmax(torch.randn(11, 4), -1).half()
    windows = [(s.features(), s.ids, s.start, eagle_fit.first_anchor(s.answer_start, 4))
               for s in shards]
    with torch.no_grad():
        together = eagle_fit.packed_logits(head, windows, 4)
        apart = [eagle_fit.unrolled_logits(head, f, i, s, 4, first) for f, i, s, first in windows]
        assert [len(x) for x in apart[1]] == [3, 2, 1]  # no depth-3 step in a 3-row window
        for d, rows in enumerate(together):
            assert torch.allclose(rows, torch.cat([a[d] for a in apart if d < len(a)]),
                                  atol=1e-4), d
    want, count = torch.zeros(()), 0
    for s in shards:
        n = int((s.labels(t2d, 0) >= 0).sum())
        want, count = want + n * eagle_fit.Sequences([s], 4, soft=True).loss(head, t2d), count + n
    (want / count).backward()
    grad = head.fc.weight.grad.clone()
    head.zero_grad()
    got = eagle_fit.Sequences(shards, 4, soft=True).loss(head, t2d)
    got.backward()
    assert torch.allclose(got, want / count, atol=1e-5)
    assert torch.allclose(head.fc.weight.grad, grad, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_identity_float32(k):
    target = tiny(6)
    prompt = [5, 9, 2, 6, 5, 3, 5, 8]
    want = plain_greedy(target, prompt, 40)
    for vocab in (None, 40):
        drafter = Eagle3Drafter(eagle_for(target, vocab))
        out = SpeculativeDecoder(target, drafter, k, prefix_cache=False).generate(
            prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        assert out.token_ids == want
        assert out.stats.drafted > 0


class Checked(Eagle3Drafter):
    """After each catch-up, the cache must hold exactly what a fresh cache built from
    the whole accepted prefix holds (the states recomputed by the target)."""

    def __init__(self, head, target):
        super().__init__(head)
        self.target, self.checks = target, 0

    @torch.no_grad()
    def propose(self, ctx):
        draft = super().propose(ctx)
        if self.cache.last_o is not None:
            n = len(ctx.tokens)
            ref = Eagle3Cache()
            ref.reset(self.cache.base)
            aux = states(self.target, ctx.tokens[:n - 1], self.hidden_layers)
            enter(self.head, ref, aux[self.cache.base:], torch.tensor(
                ctx.tokens[self.cache.base + 1:n]))
            assert ref.end == self.cache.end == n - 1
            torch.testing.assert_close(ref.k, self.cache.k, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(ref.last_o, self.cache.last_o, rtol=1e-4, atol=1e-3)
            self.checks += 1
        return draft


def states(target: Transformer, ids: list[int], layers) -> torch.Tensor:
    """[len(ids), LH] the layers' states at every position, from a fresh side pass."""
    seq = target.sequence(3)
    out = seq.prefill(torch.tensor(ids), hidden_layers=layers, hidden_all=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1)


def test_cache_follows_accepts_plain_steps_and_turns():
    """Against a recomputed cache at every proposal: rejected chains, steps the
    controller ran plain (k = 0 between), and a second turn on the prefix cache."""
    target = tiny(7)
    drafter = Checked(eagle_for(target, seed=3), target)
    dec = SpeculativeDecoder(target, drafter, 3)
    prompt = [4, 8, 15, 16, 23, 42]
    first = dec.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    turn2 = prompt + first.token_ids + [7, 7, 1]
    second = dec.generate(turn2, SamplingParams(max_tokens=20, ignore_eos=True))
    assert second.token_ids == plain_greedy(target, turn2, 20)
    assert second.stats.cached_tokens > 0 and drafter.checks > 10
    assert drafter.cache.base == 0  # the second turn kept the first's entries


def test_plain_steps_between_drafts_keep_the_context():
    """A drafter asked only every third step still sees every accepted state."""
    target = tiny(8)

    class Sometimes(Checked):
        calls = 0

        def propose(self, ctx):
            self.calls += 1
            return super().propose(ctx) if self.calls % 3 == 1 else _empty()

    drafter = Sometimes(eagle_for(target), target)
    prompt = [1, 2, 3, 4, 5]
    out = SpeculativeDecoder(target, drafter, 2, prefix_cache=False).generate(
        prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert out.token_ids == plain_greedy(target, prompt, 24) and drafter.checks >= 3


def _empty():
    from specdecode.drafters.base import Draft
    return Draft.empty()


def test_context_shard_rows():
    """answer_with_context: ids = prompt tail + answer, aux row p = the states at
    x_{s+p} (checked against a side pass over the same tokens)."""
    target = tiny(9)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    layers = (0, 1)
    shard = data.answer_with_context(target, prompt, 10, (), layers, context=5)
    answer = plain_greedy(target, prompt, 10)
    s = int(shard["start"][0])
    assert s == 3 and shard["ids"].tolist() == prompt[s:] + answer
    assert int(shard["answer_start"][0]) == 5
    full = states(target, prompt + answer[:-1], layers)
    assert torch.allclose(shard["aux"].float(), full[s:], atol=2e-3)


@pytest.mark.slow
def test_sampling_preserves_the_target_distribution():
    """Chi-square on the first two tokens at T = 1 with the head's q (k = 3); the
    always-accept verifier fails the same test (negative control)."""
    from test_distribution import always_accept, chi_square_pvalue, exact_joint, sample_joint
    from test_hidden_head import small_target
    target = small_target(4)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_joint(target, params)
    good = SpeculativeDecoder(target, Eagle3Drafter(eagle_for(target)), 3)
    assert chi_square_pvalue(sample_joint(good, params, 4000), exact) > 1e-3

    def broken(params, key, generator):
        return SamplingVerifier(params, key, generator, rejection=always_accept)
    bad = SpeculativeDecoder(target, Eagle3Drafter(eagle_for(target)), 3, verifier=broken)
    assert chi_square_pvalue(sample_joint(bad, params, 2000), exact) < 1e-6


def exported(tmp_path, head: Eagle3Head, target: Transformer):
    """The head in the speculators format, with a local verifier folder (an HF config
    and the target's embedding / lm_head / norm) that the package can read."""
    import json

    from safetensors.torch import save_file

    from specdecode.train import speculators
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    c = target.config
    (verifier / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "intermediate_size": c.intermediate_size}))
    save_file({"model.embed_tokens.weight": target.embed_tokens.weight.detach().clone(),
               "lm_head.weight": target.lm_head.weight.detach().clone(),
               "model.norm.weight": target.norm.weight.detach().clone()},
              str(verifier / "model.safetensors"))
    return speculators.export(tmp_path / "spec", head.config, head.state_dict(),
                              verifier=str(verifier), architecture="LlamaForCausalLM", k=3)


@pytest.mark.parametrize("intermediate", [None, 24])
def test_export_round_trip_drafts_the_same(tmp_path, intermediate):
    """Export, validate, import: the imported head drafts the same tokens; our own
    save/load likewise; the exported ids are vLLM's (ours + 1); a head narrower than
    the target's layers (--head-intermediate) keeps its width."""
    import json

    from specdecode.train import speculators
    target = tiny(10)
    head = eagle_for(target, 40, seed=2, intermediate=intermediate)
    assert head.config.intermediate_size == (intermediate or target.config.intermediate_size)
    folder = exported(tmp_path, head, target)
    assert speculators.validate(folder, target_layers=target.config.num_layers,
                                target_vocab=target.config.vocab_size,
                                hidden_size=target.config.hidden_size) == []
    raw = json.loads((folder / "config.json").read_text())
    assert raw["transformer_layer_config"]["intermediate_size"] == head.config.intermediate_size
    assert raw["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in head.config.aux_layers]
    prompt = [2, 7, 1, 8, 2, 8]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    runs = []
    for h in (head, speculators.load_any(folder, target.embed_tokens.weight),
              speculators.load_any(head.save(tmp_path / "ours"), target.embed_tokens.weight)):
        out = SpeculativeDecoder(target, Eagle3Drafter(h), 3, prefix_cache=False).generate(
            prompt, params)
        runs.append((out.token_ids, out.stats.accepted, out.stats.drafted))
    assert runs[0] == runs[1] == runs[2] and runs[0][0] == plain_greedy(target, prompt, 30)


def test_validator_names_what_vllm_would_reject(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from specdecode.train import speculators
    target = tiny(11)
    folder = exported(tmp_path, eagle_for(target, 40), target)
    weights = load_file(str(folder / "model.safetensors"))

    def broken(**changes):
        bad = {**weights, **changes}
        bad = {k: v for k, v in bad.items() if v is not None}
        save_file(bad, str(folder / "model.safetensors"))
        return speculators.validate(folder)

    assert any("fc.weight: shape" in p for p in broken(**{"fc.weight": torch.zeros(3, 3)}))
    assert broken(**{"norm.weight": None}) == ["norm.weight: missing"]
    d2t = weights["d2t"].clone()
    d2t[1] = d2t[0] - 1  # draft tokens 0 and 1 on one target token
    assert broken(d2t=d2t) == ["d2t maps two draft tokens to one target token"]
    t2d = weights["t2d"].clone()
    t2d[-1] = not t2d[-1]
    assert broken(t2d=t2d) == ["t2d does not mark exactly d2t's target ids"]
    broken()
    raw = json.loads((folder / "config.json").read_text())
    raw["speculators_config"]["algorithm"] = "eagle"
    (folder / "config.json").write_text(json.dumps(raw))
    assert "speculators_config.algorithm must be 'eagle3'" in speculators.validate(folder)
    assert speculators.validate(folder, target_layers=1)[-1].startswith(
        "eagle_aux_hidden_state_layer_ids")
    with pytest.raises(ValueError, match="algorithm"):
        speculators.load(folder, target.embed_tokens.weight)


def test_speculators_package_reads_the_export(tmp_path):
    """The speculators package (vLLM's format library) loads the exported config and
    weights: every tensor we wrote is the one its Eagle3DraftModel holds."""
    if not os.environ.get("CI"):  # .ci/run installs it (--no-deps: see there)
        pytest.importorskip("speculators")
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    from specdecode.train import speculators
    target = tiny(12)
    head = eagle_for(target, 40)
    folder = exported(tmp_path, head, target)
    assert speculators.package_check(folder) == []
    model = Eagle3DraftModel.from_pretrained(str(folder))
    theirs = model.state_dict()
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        assert torch.equal(theirs[name].to(tensor.dtype), tensor), name
    assert list(model.config.eagle_aux_hidden_state_layer_ids) == [
        i + 1 for i in head.config.aux_layers]
    assert model.config.draft_vocab_size == 40


@pytest.mark.slow
def test_end_to_end_on_smollm2(tmp_path):
    """Collect context shards (resumable), train with the unrolled loss, export, load
    by name, draft: the trained head's held-out acceptance beats the untrained
    head's clearly; greedy output is plain's (torch float32)."""
    import real
    from specdecode.train import fit, speculators
    loaded = real.load("smollm2-135m")
    target, tok = loaded.model, loaded.tokenizer
    encode = lambda p: tok.chat([{"role": "user", "content": p}])  # noqa: E731
    stops = tuple(target.config.eos_token_ids)
    layers = Eagle3Config_layers(target)
    answer = lambda ids: data.answer_with_context(  # noqa: E731
        target, ids, 32, stops, layers, context=64)
    paths = data.collect(target, encode, data.docstring_prompts(16), tmp_path / "train",
                         progress=False, answer=answer)
    assert data.collect(target, encode, data.docstring_prompts(16), tmp_path / "train",
                        progress=False, answer=None) == paths  # resumed: no work
    val_paths = data.collect(target, encode, data.docstring_prompts(5, skip=60),
                             tmp_path / "val", progress=False, answer=answer)
    train = eagle_fit.load_windows(paths)
    answers = [(w.ids[w.answer_start:], None) for w in train]
    d2t = fit.draft_vocabulary(answers, 2048, target.config.vocab_size, always=stops)
    head = eagle_fit.new_head(target.embed_tokens.weight, target.lm_head.weight, d2t,
                              target.config, layers)
    wt = eagle_fit.Sequences(train, 3)
    wv = eagle_fit.Sequences(eagle_fit.load_windows(val_paths), 3)
    untrained = wv.acceptance(head)
    result = fit.fit(head, wt, wv, steps=100, batch=256, lr=2e-3, evals=2)
    trained = result.curve[-1]["accept"]
    print("eagle3 smollm2: untrained", untrained, "trained", trained, "tau", result.tau)
    assert trained[0] > untrained[0] + 0.15 and result.tau > 1 + sum(untrained) + 0.2
    folder = exported(tmp_path, head, target)
    assert speculators.validate(folder, target_layers=target.config.num_layers) == []
    prompt = encode(data.docstring_prompts(1, skip=80)[0])
    want = plain_greedy(target, prompt, 40)
    from specdecode.llm import LLM
    llm = LLM.load("smollm2-135m", drafter="eagle3", head=str(folder), k=3,
                   dtype="float32", backend="torch", adaptive=False)
    out = llm.decoder.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert out.token_ids == want and out.stats.accepted > 0


def Eagle3Config_layers(target):
    from specdecode.drafters.eagle import Eagle3Config
    return Eagle3Config.default_layers(target.config.num_layers)


def test_export_command(tmp_path):
    """`specdecode export`: the vllm serve line on stdout; bad input one line, exit 2."""
    from test_cli import assert_clean_error, run
    target = tiny(13)
    head = eagle_for(target, 40).save(tmp_path / "head")
    done = run("export", "--head", str(head), "--out", str(tmp_path / "out"),
               "--target", "smollm2-135m")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"vllm serve {(tmp_path / 'out').resolve()}"
    assert "speculators" in done.stderr
    assert_clean_error(run("export", "--head", str(tmp_path / "none"), "--out",
                           str(tmp_path / "x")), "config.json")
    assert_clean_error(run("export", "--head", str(head), "--out", str(tmp_path / "y"),
                           "--target", "my/own"), "--verifier")
    (tmp_path / "hh").mkdir()
    (tmp_path / "hh" / "config.json").write_text('{"format": "specdecode-hidden-head-v1"}')
    assert_clean_error(run("export", "--head", str(tmp_path / "hh"), "--out",
                           str(tmp_path / "z")), "not a specdecode-eagle3-v1 head")


def test_a_gap_longer_than_the_rows_kept_restarts_the_cache():
    """With fewer rows kept than the plain steps between proposals, the cache
    restarts from the rows it has (base > 0) and output stays plain's."""
    target = tiny(14)

    class Rarely(Checked):
        context_rows, calls = 2, 0

        def propose(self, ctx):
            self.calls += 1
            return super().propose(ctx) if self.calls % 4 == 1 else _empty()

    drafter = Rarely(eagle_for(target), target)
    prompt = [9, 8, 7, 6, 5]
    out = SpeculativeDecoder(target, drafter, 2, prefix_cache=False).generate(
        prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    assert out.token_ids == plain_greedy(target, prompt, 30)
    assert drafter.checks >= 3 and drafter.cache.base > 0


@pytest.mark.parametrize("context", [5, None])
def test_batched_collection_equals_one_at_a_time(tmp_path, context):
    """collect_batched (3 prompts at a time, 5 prompts of different lengths, one with
    no room) writes the shards collect writes one prompt at a time: same tokens,
    states within a batched pass's rounding; a second call resumes with no work."""
    target = tiny(9)
    prompts = ["3 1 4 1 5 9", "2 6", "5 3 5 8 9 7 9 3", "1", "2 3 8 4 6 2 6 4 3"]
    encode = lambda p: [int(x) for x in p.split()]  # noqa: E731
    layers = (0, 1) if context else (data.FINAL_LAYER,)
    answer = (lambda ids: data.answer_with_context(  # noqa: E731
        target, ids, 7, (4,), layers, context)) if context else None
    one = data.collect(target, encode, prompts, tmp_path / "one", max_new_tokens=7,
                       stop_ids=(4,), progress=False, answer=answer)
    plan = data.BatchPlan(3, layers, context)
    many = data.collect_batched(target, encode, prompts, tmp_path / "many", plan,
                                max_new_tokens=7, stop_ids=(4,), order=[4, 3, 2, 1, 0],
                                progress=False)
    from safetensors.torch import load_file
    for a, b in zip(one, many):
        x, y = load_file(str(a)), load_file(str(b))
        assert x.keys() == y.keys()
        for key in x:
            if x[key].is_floating_point():
                assert x[key].shape == y[key].shape
                assert torch.allclose(x[key].float(), y[key].float(), atol=2e-3)
            else:
                assert torch.equal(x[key], y[key]), key
    stamp = [p.stat().st_mtime_ns for p in many]
    data.collect_batched(target, encode, prompts, tmp_path / "many", plan,
                         max_new_tokens=7, stop_ids=(4,), progress=False)
    assert [p.stat().st_mtime_ns for p in many] == stamp


def test_sampled_answers_share_a_prefill_and_are_labelled_greedy(tmp_path):
    """BatchPlan.samples: a run over a greedy run's folder keeps its shards and adds
    two sampled answers per prompt (none for the greedy_only one), seeded (a fresh
    run draws the same tokens). A sampled shard's prompt rows are the greedy
    shard's; its `greedy` row p is the target's argmax after the sampled prefix
    (a fresh teacher-forced pass), and its training labels are those tokens."""
    import shutil

    from safetensors.torch import load_file
    target = tiny(9)
    prompts = ["3 1 4 1 5 9", "2 6", "5 3 5 8 9 7 9 3", "2 3 8 4 6 2 6 4 3"]
    encode = lambda p: [int(x) for x in p.split()]  # noqa: E731
    layers, context = (0, 1), 5
    with pytest.raises(ValueError):
        data.BatchPlan(2, layers, context, samples=3)
    with pytest.raises(ValueError):
        data.BatchPlan(3, layers, None, samples=2)
    one = data.collect_batched(target, encode, prompts, tmp_path / "one",
                               data.BatchPlan(3, layers, context), max_new_tokens=7,
                               stop_ids=(4,), progress=False)
    shutil.copytree(tmp_path / "one", tmp_path / "many")
    stamp = [(tmp_path / "many" / p.name).stat().st_mtime_ns for p in one]
    plan = data.BatchPlan(3, layers, context, samples=3, temperature=1.0)
    runs = [data.collect_batched(target, encode, prompts, tmp_path / name, plan,
                                 max_new_tokens=7, stop_ids=(4,), greedy_only=[3],
                                 progress=False) for name in ("many", "fresh")]
    many = runs[0]
    assert [p.name for p in many[:4]] == ["000000.safetensors", "000000-s1.safetensors",
                                          "000000-s2.safetensors", "000001.safetensors"]
    assert len(many) == 3 * 3 + 1 and many[-1].name == "000003.safetensors"
    assert [p.stat().st_mtime_ns for p in many if "-s" not in p.name] == stamp
    differ = 0
    for path, again in zip(many, runs[1]):
        if "-s" not in path.name:
            continue
        shard, greedy_shard = load_file(str(path)), load_file(str(path.parent / (
            path.name.split("-")[0] + ".safetensors")))
        assert torch.equal(shard["ids"], load_file(str(again))["ids"])
        a = int(shard["answer_start"][0])
        assert torch.equal(shard["ids"][:a], greedy_shard["ids"][:a])
        assert torch.allclose(shard["aux"][:a - 1].float(), greedy_shard["aux"][:a - 1].float())
        differ += not torch.equal(shard["ids"], greedy_shard["ids"])
        prompt = encode(prompts[int(path.name[:6])])
        answer = shard["ids"][a:].tolist()
        target.rollback(0)
        out = target.forward(torch.tensor(prompt + answer[:-1]), last_n=len(answer))
        assert shard["greedy"][a - 1:].tolist() == out.logits.argmax(-1).tolist()
        assert (shard["greedy"][:a - 1] == -1).all()
        window = eagle_fit.load_windows([path])[0]
        labels = window.labels(torch.arange(target.vocab_size), 0)
        p = torch.arange(a - 2, len(labels) - 1)
        assert torch.equal(labels[p], shard["greedy"][p + 1])
    assert differ >= 3


def test_sampled_answer_tokens_follow_the_tempered_distribution():
    """data.draw samples softmax(logits / T): chi-square over 20,000 draws accepts
    it and rejects T = 1 (the negative control); a token of probability 0 (a -inf
    logit) is never drawn."""
    from specdecode.check.chisquare import chi_square_pvalue
    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(40, generator=g)  # [40]
    logits[7] = float("-inf")
    counts = torch.bincount(torch.tensor([data.draw(logits, 0.8, g) for _ in range(20000)]),
                            minlength=40)
    assert counts[7] == 0
    assert chi_square_pvalue(counts, torch.softmax(logits / 0.8, -1)) > 1e-3
    assert chi_square_pvalue(counts, torch.softmax(logits, -1)) < 1e-6


def test_batched_collection_stops_at_the_deadline(tmp_path):
    """Past the deadline no prompt is started: the prompts in `order` before it are
    answered, the others get no shard."""
    import time
    target = tiny(9)
    plan = data.BatchPlan(2, (0, 1), 4, deadline=time.monotonic() - 1)
    paths = data.collect_batched(target, lambda p: [1, 2, 3], ["a", "b", "c"], tmp_path,
                                 plan, max_new_tokens=4, progress=False)
    assert not any(p.is_file() for p in paths)


def test_training_scale_folds_into_fc():
    """input_scale brings every aux column to unit RMS (a column 1000x the others
    included); after fold_scale the head on raw states gives the logits the
    training head gave on scaled ones."""
    target = tiny(9)
    head = eagle_for(target)
    torch.manual_seed(1)
    aux = torch.randn(12, head.fc.in_features)
    aux[:, 3] *= 1000
    shard = eagle_fit.Shard(aux.clone(), torch.randint(0, 50, (13,)), 2, 0)
    scale = eagle_fit.input_scale([shard])
    eagle_fit.scale_windows([shard], scale)
    assert torch.equal(shard.aux, aux)  # the stored states stay as they are
    features = shard.features()
    assert torch.allclose(features.pow(2).mean(0), torch.ones(aux.shape[1]), atol=1e-4)
    trained = eagle_fit.unrolled_logits(head, features, shard.ids, 0, 2)
    eagle_fit.fold_scale(head, scale)
    raw = eagle_fit.unrolled_logits(head, aux, shard.ids, 0, 2)
    for a, b in zip(trained, raw):
        assert torch.allclose(a, b, atol=1e-3)


def test_walked_tau_skips_the_anchors_inside_accepted_runs():
    """Chains of 2, 0, 0 accepted (and the two skipped anchors' 2s): the engine takes
    3 tokens, then 1, then 1 over 3 steps (5 / 3), where every anchor alike gives
    (3 + 3 + 3 + 1 + 1) / 5; k caps each chain."""
    lengths = [torch.tensor([2, 2, 2, 0, 0])]
    assert eagle_fit.walked_tau(lengths, 4) == pytest.approx(5 / 3)
    assert eagle_fit.walked_tau(lengths, 1) == pytest.approx((2 + 2 + 1) / 3)  # at 0, 2, 4
    assert eagle_fit.walked_tau([torch.tensor([], dtype=torch.long)], 4) == 0.0
