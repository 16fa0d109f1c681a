"""The llama.cpp prefill copy (models/llama_cpp_prefill.py): long new parts decoded by a
plain-layout second model and their cells moved back.

SmolLM2's Q4_1 weights have no repacked layout, so there the copy runs the same
kernels as the owner: its passes must give the owner's logits bit for bit, which
checks the cache moves (in, out, after a prefix, on a second sequence, on errors).
The default target (Q4_K, repacked) checks what the copy is for, in a slow test.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import real
from specdecode.models import llama_cpp

if not llama_cpp.available():
    if os.environ.get("CI"):
        raise RuntimeError("CI must test the llama.cpp backend: run specdecode build-llama-cpp")
    pytest.skip("llama.cpp is not built (specdecode build-llama-cpp)", allow_module_level=True)
from specdecode.models import llama_cpp_prefill  # noqa: E402
from specdecode.models.llama_cpp import LlamaCppLM  # noqa: E402

PROMPT = list(range(200, 360))  # [160] token ids: one pass on the copy (>= MIN_NEW)
MORE = list(range(500, 620))  # [120]: a second long part, after a cached prefix


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaCppLM, LlamaCppLM]:
    """(with the copy, without): the same GGUF."""
    path = real.path("smollm2-135m")
    return (LlamaCppLM(path, max_seq_len=512, n_threads=2, prefill_copy=True),
            LlamaCppLM(path, max_seq_len=512, n_threads=2))


def run(lm, parts: list[list[int]], steps: int = 4) -> tuple[torch.Tensor, list[int]]:
    """Prefill parts[0], greedy `steps` one-token steps, then each further part as one
    pass and `steps` more; every scored row's logits and the cache's ids."""
    rows = [lm.prefill(torch.tensor(parts[0])).logits[-1]]
    for part in [None, *parts[1:]]:
        if part is not None:
            rows.append(lm.forward(torch.tensor(part), last_n=1).logits[-1])
        for _ in range(steps):
            nxt = int(rows[-1].argmax())
            rows.append(lm.forward(torch.tensor([nxt]), last_n=1).logits[-1])
    return torch.stack(rows), list(lm.cached_ids)


def test_long_parts_go_to_the_copy_and_score_as_the_owner(pair):
    copied, plain = pair
    assert copied._prefill_copy is not None and plain._prefill_copy is None
    assert "plain-layout copy from 96 tokens" in repr(copied)
    got, ids = run(copied, [PROMPT, MORE])
    want, want_ids = run(plain, [PROMPT, MORE])
    assert ids == want_ids and copied.cached_len == len(want_ids)
    assert torch.equal(got, want)
    # the copy's sequence holds what it decoded last: the prompt, 4 steps and MORE
    assert copied._prefill_copy.lm.cached_ids == ids[:len(PROMPT) + 4 + len(MORE)]


def test_short_passes_stay_on_the_owner(pair):
    copied, _ = pair
    copy = copied._prefill_copy
    copied.prefill(torch.tensor(PROMPT[:40]))  # < min_new: not the copy's
    assert copy.lm.cached_len == 0 or copy.lm.cached_ids != copied.cached_ids
    assert copy.min_new == llama_cpp_prefill.FORCED_MIN_NEW
    assert not copy.pays(0, copy.min_new - 1) and copy.pays(0, copy.min_new)
    # a long part after a much longer cache costs more to move than it saves
    assert copy.pays(5000, 100) and not copy.pays(20000, 100)


def test_a_second_sequence_is_prefilled_through_the_copy(pair):
    """A second sequence makes the owner's context a unified multi-sequence one; the
    copy's pass is a one-sequence context's (what a fresh model computes), and the cells
    it moves back are that context's, byte for byte. (The next token's scores are not
    compared: in a unified cache they depend on where the cells lie, which differs
    between two models' histories.)"""
    copied, _ = pair
    seq = copied.sequence(1)
    copied.prefill(torch.tensor(MORE))  # sequence 0 holds something else meanwhile
    got = seq.prefill(torch.tensor(PROMPT)).logits
    fresh = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=512, n_threads=2)
    assert torch.equal(got, fresh.prefill(torch.tensor(PROMPT)).logits)
    assert seq.cached_ids == PROMPT and copied.cached_ids == MORE
    moved, made = bytes(seq.snapshot().data), bytes(fresh.snapshot().data)
    meta = 16 + 12 * len(PROMPT)  # a header and each cell's (position, sequence id) record
    assert len(moved) == len(made) > 10 * meta and moved[meta:] == made[meta:]


def test_a_failed_pass_leaves_the_cache_as_it_was(pair, monkeypatch):
    copied, _ = pair
    copied.prefill(torch.tensor(PROMPT))
    with pytest.raises(ValueError, match="context limit"):  # refused before the copy
        copied.forward(torch.tensor(list(range(1000, 1400))), last_n=1)
    assert copied.cached_ids == PROMPT
    after = copied.forward(torch.tensor([5]), last_n=1).logits

    def broken(*args, **kw):
        raise RuntimeError("llama_decode failed")

    with monkeypatch.context() as m:  # the copy's own pass fails
        m.setattr(copied._prefill_copy.lm, "_decode", broken)
        with pytest.raises(RuntimeError, match="llama_decode failed"):
            copied.forward(torch.tensor(MORE), last_n=1)
    assert copied.cached_ids == PROMPT + [5]
    copied.rollback(len(PROMPT))
    assert torch.equal(after, copied.forward(torch.tensor([5]), last_n=1).logits)


def test_a_failed_move_back_empties_the_sequence(pair, monkeypatch):
    """llama.cpp refusing the cells (set_data copies nothing): a RuntimeError and an
    empty, consistent sequence that the next prompt fills again."""
    copied, plain = pair
    copied.prefill(torch.tensor(PROMPT))
    lib = copied._lib
    calls = []

    def refuse_second(ctx, src, size, seq_id, real=lib.llama_state_seq_set_data):
        calls.append(seq_id)  # the first move (into the copy) works, the way back not
        return real(ctx, src, size, seq_id) if len(calls) == 1 else 0

    with monkeypatch.context() as m:
        m.setattr(lib, "llama_state_seq_set_data", refuse_second)
        with pytest.raises(RuntimeError, match="could not move"):
            copied.forward(torch.tensor(MORE), last_n=1)
    assert copied.cached_len == 0 and copied.cached_ids == []
    assert torch.equal(copied.prefill(torch.tensor(PROMPT)).logits,
                       plain.prefill(torch.tensor(PROMPT)).logits)


def test_decide_forced_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    path = real.path("smollm2-135m")

    def copy_of():
        return LlamaCppLM(path, max_seq_len=256, n_threads=2, prefill_copy=None)._prefill_copy

    monkeypatch.setenv("SPECDECODE_PREFILL_COPY", "1")
    assert copy_of().min_new == llama_cpp_prefill.FORCED_MIN_NEW
    monkeypatch.setenv("SPECDECODE_PREFILL_COPY", "0")
    assert copy_of() is None
    monkeypatch.delenv("SPECDECODE_PREFILL_COPY")
    copy_of()  # measured once (Q4_1 is not repacked: the same kernels both ways)
    [saved] = (tmp_path / "costs").glob("prefill-copy-*.json")
    record = json.loads(saved.read_text())
    sizes = [str(n) for n in llama_cpp_prefill.PROBE_SIZES]
    assert list(record["repacked_s"]) == sizes and list(record["plain_s"]) == sizes
    assert all(t > 0 for t in [*record["repacked_s"].values(), *record["plain_s"].values()])
    record["min_new"] = 33  # a cached answer is used without measuring again
    saved.write_text(json.dumps(record))
    assert copy_of().min_new == 33 and llama_cpp_prefill.planned(path)
    record["min_new"] = None
    saved.write_text(json.dumps(record))
    assert copy_of() is None and not llama_cpp_prefill.planned(path)


def test_decide_times_only_sizes_the_context_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDECODE_PREFILL_COPY", raising=False)
    lm = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=64, n_threads=2, prefill_copy=None)
    assert lm.cached_len == 0
    [saved] = (tmp_path / "costs").glob("prefill-copy-*.json")
    assert list(json.loads(saved.read_text())["plain_s"]) == ["17", "33"]


def test_no_copy_where_twice_its_memory_is_not_free(monkeypatch):
    monkeypatch.setenv("SPECDECODE_PREFILL_COPY", "1")
    monkeypatch.setattr(llama_cpp_prefill.limits, "available_bytes", lambda: 150 << 20)
    lm = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2, prefill_copy=None)
    assert lm._prefill_copy is None


@pytest.mark.parametrize("plain, min_new", [
    ({17: 1.2, 33: 1.6, 65: 3.0, 128: 5.0}, 33),  # pays from 33 tokens on
    ({17: 0.5, 33: 1.6, 65: 3.9, 128: 5.0}, 128),  # 65 does not: only 128 (not 17)
    ({17: 1.0, 33: 2.0, 65: 4.0, 128: 8.0}, None),  # the same times: never
])
def test_decide_takes_the_smallest_size_from_which_on_the_copy_pays(
        tmp_path, monkeypatch, plain, min_new):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDECODE_PREFILL_COPY", raising=False)
    repacked = {17: 1.0, 33: 2.0, 65: 4.0, 128: 8.0}
    monkeypatch.setattr(llama_cpp_prefill, "_probe", lambda lm, n: (
        plain if lm._prefill_copy is None and not lm.extra_bufts else repacked)[n])
    lm = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2)
    assert lm.extra_bufts
    assert llama_cpp_prefill.decide(lm) == min_new


def test_a_measured_load_keeps_the_copy_it_measured(tmp_path, monkeypatch):
    """The first load on a machine measures on a copy; where the copy pays, that copy
    is the one kept (one plain-layout load, not two); where it does not, it is closed."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDECODE_PREFILL_COPY", raising=False)
    times = {17: 1.0, 33: 2.0, 65: 4.0, 128: 8.0}
    probe = llama_cpp_prefill._probe  # the real passes run; their times are set
    monkeypatch.setattr(llama_cpp_prefill, "_probe", lambda lm, n: 0 * probe(lm, n) + times[n] * (
        0.5 if lm._prefill_copy is None and not lm.extra_bufts else 1.0))
    opened, closed = [], []
    init, close = llama_cpp_prefill.PrefillCopy.__init__, llama_cpp_prefill.PrefillCopy.close
    monkeypatch.setattr(llama_cpp_prefill.PrefillCopy, "__init__",
                        lambda self, *a, **k: (opened.append(self), init(self, *a, **k))[1])
    monkeypatch.setattr(llama_cpp_prefill.PrefillCopy, "close",
                        lambda self: (closed.append(self), close(self))[1])
    lm = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2, prefill_copy=None)
    assert lm._prefill_copy is opened[0] and len(opened) == 1 and not closed
    assert lm._prefill_copy.min_new == 17 and lm._prefill_copy.lm.cached_len == 0
    plain = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2,
                       prefill_copy=False)  # Q4_1: the same kernels either way
    assert torch.equal(lm.prefill(torch.tensor(PROMPT)).logits,
                       plain.prefill(torch.tensor(PROMPT)).logits)
    plain.close()
    lm.close()
    for saved in (tmp_path / "costs").glob("prefill-copy-*.json"):
        saved.unlink()
    times[17] = 10.0  # 17 tokens: 5.0 on the copy, 10.0 repacked, from 33 on the same
    monkeypatch.setattr(llama_cpp_prefill, "_probe", lambda lm, n: times[n] if n != 17 or (
        lm._prefill_copy is not None or lm.extra_bufts) else 5.0)
    lm = LlamaCppLM(real.path("smollm2-135m"), max_seq_len=256, n_threads=2, prefill_copy=None)
    assert lm._prefill_copy is None and closed[-1] is opened[-1] and len(opened) == 2


@pytest.mark.slow
def test_default_target_prompt_through_the_copy():
    """The default target's Q4_K weights are repacked: the copy's prompt pass rounds apart
    from the owner's in the last bits; the next token's scores stay close, and greedy
    speculative decoding over the copy's cache follows plain decoding over it, parting
    (if at all) only at a near-tie, as llama.cpp's batches do (README "Exactness")."""
    from specdecode import NgramDrafter, SamplingParams, SpeculativeDecoder
    from specdecode.models.loading import load_tokenizer

    path = real.path("default")
    copied = LlamaCppLM(path, max_seq_len=1024, prefill_copy=True)
    assert copied.extra_bufts, "the default target's weights should be repacked here"
    tok = load_tokenizer(path)
    prompt = tok.encode("import re\n\n" + re_source()[:1500] + "\n\ndef escape_all(words):\n")
    assert len(prompt) >= copied._prefill_copy.min_new
    via_copy = copied.prefill(torch.tensor(prompt)).logits[-1]
    copied._prefill_copy, copy = None, copied._prefill_copy
    own = copied.prefill(torch.tensor(prompt)).logits[-1]
    copied._prefill_copy = copy
    assert (via_copy - own).abs().max() < 0.5 * own.std()
    assert copied._prefill_copy.lm.cached_len == len(prompt)  # the copy ran the prompt
    plain, margins = greedy_with_margins(copied, prompt, 48)
    for min_new in (96, 4):  # verifications on the repacked weights, then on the copy
        copied._prefill_copy.min_new = min_new
        spec = SpeculativeDecoder(copied, NgramDrafter(), 6, prefix_cache=False).generate(
            prompt, SamplingParams(max_tokens=48))
        assert spec.stats.drafted > 0
        parted = next((i for i, (a, b) in enumerate(zip(spec.token_ids, plain)) if a != b),
                      None)
        assert parted is None or margins[parted] < 0.25, (min_new, parted, margins[parted])
    copied.close()


def greedy_with_margins(lm, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding (one-token steps) and each step's top-2 logit margin."""
    logits, out, margins = lm.prefill(torch.tensor(prompt)).logits[-1], [], []
    for _ in range(n):
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        out.append(int(logits.argmax()))
        logits = lm.forward(torch.tensor(out[-1:]), last_n=1).logits[-1]
    return out, margins


def re_source() -> str:
    import re

    with open(re.__file__) as f:
        return f.read()
