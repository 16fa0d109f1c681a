"""Prompts the target writes itself (train/self_prompts.py) and a distillation run
that trains on them beside the training sets (train/run.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.train import self_prompts
from specdecode.train.run import RunOptions, distil


@pytest.fixture(scope="module")
def smollm2():
    import real
    return real.load("smollm2-135m")


def test_user_turn_is_the_template_up_to_the_user_content(smollm2):
    tok = smollm2.tokenizer
    prefix, end = self_prompts.user_turn(tok)
    assert prefix.endswith("<|im_start|>user\n")
    assert tok.hf.convert_ids_to_tokens(end) == "<|im_end|>"
    assert tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=False).startswith(prefix + "hi")


class _PlainEndTemplate:
    """A tokenizer whose template ends a user message in plain text ([/INST])."""

    control_tokens = frozenset({"<s>", "</s>"})

    class hf:  # noqa: N801
        @staticmethod
        def apply_chat_template(messages, **kw):
            return f"<s>[INST] {messages[0]['content']} [/INST]"

        @staticmethod
        def encode(text, add_special_tokens=False):
            return [ord(c) for c in text]

        @staticmethod
        def convert_ids_to_tokens(i):
            return chr(i)


def test_a_template_ending_the_user_turn_in_plain_text_is_refused():
    with pytest.raises(ValueError, match="control token"):
        self_prompts.user_turn(_PlainEndTemplate())


def test_ensure_keeps_order_drops_repeats_stops_and_survives_a_torn_line(tmp_path):
    """With a scripted writer: dropped and repeated requests are recorded null and
    the next indices tried; nothing is written when enough are kept; a last line
    cut short is dropped and its batch tried again; a writer that never ends a
    request stops after 4 n + batch indices with what it kept."""
    calls = []

    def writer(todo):
        calls.append(todo)
        return [None if i % 3 == 0 else f"request {i // 2}" for i in todo]

    path = tmp_path / "p.jsonl"
    got = self_prompts.ensure(None, None, path, 3, batch=4, writer=writer)
    assert got == ["request 0", "request 1", "request 2"]  # 1, 2 -> 0, 1; 3 null; 4 -> 2
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in records] == [None, "request 0", "request 1", None, "request 2",
                                             None, None, "request 3"]  # 5 -> 2 repeated
    assert [r["opening"] for r in records] == list(self_prompts.OPENINGS[:8])
    assert self_prompts.ensure(None, None, path, 4, batch=4, writer=writer) == got + [
        "request 3"] and len(calls) == 2
    path.write_text(path.read_text()[:-9])  # a killed append: the last line cut short
    assert self_prompts.ensure(None, None, path, 4, batch=4, writer=writer)[-1] == "request 3"
    assert calls[-1] == [7, 8, 9, 10]
    never = self_prompts.ensure(None, None, tmp_path / "q.jsonl", 5, batch=4,
                                writer=lambda todo: [None] * len(todo))
    assert never == [] and len((tmp_path / "q.jsonl").read_text().splitlines()) == 24


def test_written_prompts_are_kept_extended_and_reproducible(smollm2, tmp_path):
    """ensure keeps what it wrote: asking for more appends (earlier prompts keep their
    index); a fresh file in the same batches gets the same prompts; every kept prompt
    starts with its index's opening, is non-empty text and is never repeated; dropped
    indices are recorded as tried."""
    target, tok = smollm2.model, smollm2.tokenizer
    stops = tuple(target.config.eos_token_ids)
    kw = dict(batch=4, max_tokens=48, stop_ids=stops)
    first = self_prompts.ensure(target, tok, tmp_path / "a.jsonl", 3, **kw)
    more = self_prompts.ensure(target, tok, tmp_path / "a.jsonl", 6, **kw)
    fresh = self_prompts.ensure(target, tok, tmp_path / "b.jsonl", 6, **kw)
    assert len(first) == 3 and more[:3] == first and more == fresh
    assert len(set(more)) == 6 and all(p.strip() for p in more)
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(records)))
    assert len(records) % 4 == 0  # whole batches tried
    for r in records:
        if r["prompt"] is not None:
            assert r["opening"] == self_prompts.OPENINGS[r["index"] % len(self_prompts.OPENINGS)]
            assert r["prompt"].startswith(r["opening"])
    assert sum(r["prompt"] is not None for r in records) >= 6


def test_a_run_trains_on_the_self_written_prompts_too(smollm2, tmp_path):
    """distil with self_prompts: the validation prompts stay the training sets' own;
    the self-written prompts are answered greedily into `<folder>-self` and counted
    in the training windows; a second run reuses everything (no prompt or answer
    written again)."""
    target, tok = smollm2.model, smollm2.tokenizer
    encode = lambda p: tok.chat([{"role": "user", "content": p}])  # noqa: E731
    options = RunOptions(prompts=6, val_prompts=2, max_new_tokens=12, steps=2, batch=64,
                         drafter="eagle3", context=32, answer_batch=4, self_prompts=3,
                         lr=1e-3)
    embed, lm_head = target.embed_tokens.weight, target.lm_head.weight
    stops = tuple(target.config.eos_token_ids)
    cache = tmp_path / "cache"

    def run(i: int) -> dict:
        return distil(target, encode, embed, lm_head, stops, cache, tmp_path / f"head{i}",
                      options, progress=False, tokenizer=tok)

    def written() -> dict:
        return {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}

    runs = [run(0)]
    before = written()
    runs.append(run(1))
    assert written() == before
    from specdecode.drafters.eagle import Eagle3Config
    name = "eagle3-{}-{}-{}-ctx32".format(*Eagle3Config.default_layers(target.config.num_layers))
    folders = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert folders == [name, name + "-self", "self-prompts.jsonl"]
    assert len(list((tmp_path / "cache" / folders[1]).glob("*.safetensors"))) == 3
    from specdecode.train import eagle_fit
    main = eagle_fit.load_windows([tmp_path / "cache" / name / f"{i:06d}.safetensors"
                                   for i in range(4)])  # the training prompts' (no room: none)
    for summary in runs:
        assert summary["self_prompts"] == 3 and summary["self_prompt_answers"] == 3
        assert summary["train_windows"] == len(main) + 3 and summary["validation_prompts"] == 2
    assert runs[0]["train_tokens"] == runs[1]["train_tokens"]
    assert len(self_prompts.load(tmp_path / "cache" / "self-prompts.jsonl")) >= 3
    assert torch.isfinite(torch.tensor(runs[1]["tau"]))
