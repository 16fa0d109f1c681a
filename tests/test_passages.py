"""Teacher-forced passages (train/passages.py): the windows, the text, a run that
trains on them (train/run.py)."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch

from conftest import tiny
from specdecode.train import data, eagle_fit, passages
from specdecode.train.run import RunOptions, distil

LAYERS = (0, 1)


@torch.no_grad()
def test_teacher_forcing_the_targets_own_answer_gives_its_greedy_window():
    """Over the target's own greedy answer a passage window is the collected one:
    the same ids, start and states, and every greedy label from the last prompt row
    on is the answer's next token (-1 before)."""
    target = tiny(5)
    prompt = [5, 9, 2, 6, 5, 3, 5, 8]
    got = data.answer_with_context(target, prompt, 10, (), LAYERS, 4)
    answer = got["ids"][int(got["answer_start"][0]):].tolist()
    tf = passages.teacher_forced(target, prompt, answer, LAYERS, 4)
    assert torch.equal(tf["ids"], got["ids"])
    assert (tf["answer_start"], tf["start"]) == (got["answer_start"], got["start"])
    assert torch.allclose(tf["aux"].float(), got["aux"].float(), atol=1e-2)
    a = int(tf["answer_start"][0])
    assert tf["greedy"][: a - 1].tolist() == [-1] * (a - 1)
    assert tf["greedy"][a - 1:].tolist() == tf["ids"][a:].tolist()


@torch.no_grad()
def test_labels_of_a_given_text_are_the_targets_greedy_tokens_after_each_prefix():
    """A text the target did not write: row p's label is the argmax of a fresh
    prefill of the text up to p's position; the window reads as a training Shard."""
    target = tiny(6)
    prompt, answer = [5, 9, 2, 6, 5, 3], [7, 7, 1, 40, 2, 9, 11]
    tf = passages.teacher_forced(target, prompt, answer, LAYERS, 3)
    ids, s = prompt + answer, int(tf["start"][0])
    for p in range(len(prompt) - 1 - s, len(ids) - 1 - s):
        want = int(target.prefill(torch.tensor(ids[: s + p + 1])).logits[-1].argmax())
        assert int(tf["greedy"][p]) == want, p
    assert len(set(tf["greedy"][len(prompt) - 1 - s:].tolist())) > 1
    shard = eagle_fit.Shard(tf["aux"], tf["ids"], int(tf["answer_start"][0]), s,
                            greedy=tf["greedy"])
    t2d = torch.arange(target.config.vocab_size)
    labels = shard.labels(t2d, 0)
    assert labels[-1] == -100 and labels[2:-1].tolist() == tf["greedy"][3:].tolist()


def test_no_room_gives_an_empty_window():
    target = tiny(5)
    too_long = [1] * (target.max_seq_len - 3)
    for prompt, answer in (([5], [1, 2]), ([5, 6], []), (too_long, [1, 2, 3])):
        tf = passages.teacher_forced(target, prompt, answer, LAYERS, 4)
        assert tf["aux"].shape[0] == 0


def test_passages_are_fixed_code_and_prose_in_turn():
    """The same list every call, code (a request from a docstring; the function's
    source, which parses) and prose (a topic of the language reference) in turn."""
    items = passages.passages(40)
    assert items == passages.passages(40) and len(items) == 40
    for i, (request, answer) in enumerate(items):
        if i % 2 == 0:
            assert request.startswith("Write a Python function `")
            assert answer.startswith("```python\n") and answer.endswith("\n```")
            ast.parse(textwrap.dedent(answer[len("```python\n"):-len("\n```")]))
        else:
            assert request.startswith("Explain ") and request.endswith(" in Python.")
            assert 0 < len(answer) <= passages.PROSE_CHARS or "\n\n" not in answer
    assert len({a for _, a in items}) == 40


@pytest.fixture(scope="module")
def smollm2():
    import real
    return real.load("smollm2-135m")


def test_a_run_trains_on_passages_beside_the_answers(smollm2, tmp_path):
    """distil with passages: their windows are written once into `<folder>-passages`
    (a second run writes nothing) and counted among the training windows."""
    target, tok = smollm2.model, smollm2.tokenizer
    encode = lambda p: tok.chat([{"role": "user", "content": p}])  # noqa: E731
    options = RunOptions(prompts=4, val_prompts=2, max_new_tokens=12, steps=2, batch=64,
                         drafter="eagle3", context=32, answer_batch=4, passages=3, lr=1e-3)
    embed, lm_head = target.embed_tokens.weight, target.lm_head.weight
    stops, cache = tuple(target.config.eos_token_ids), tmp_path / "cache"

    def run(i: int) -> dict:
        return distil(target, encode, embed, lm_head, stops, cache, tmp_path / f"head{i}",
                      options, progress=False, tokenizer=tok)

    first = run(0)
    written = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    second = run(1)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == written
    folder = next(p for p in cache.iterdir() if p.name.endswith("-passages-a12"))
    windows = eagle_fit.load_windows(sorted(folder.glob("*.safetensors")))
    assert len(windows) == 3 and all(w.greedy is not None for w in windows)
    main_folder = folder.with_name(folder.name[: -len("-passages-a12")])
    main = eagle_fit.load_windows(sorted(main_folder.glob("*.safetensors"))[:2])
    for summary in (first, second):
        assert summary["passages"] == 3 and summary["train_windows"] == len(main) + 3
    assert first["train_tokens"] == second["train_tokens"]
    with pytest.raises(ValueError, match="eagle3"):
        distil(target, encode, embed, lm_head, stops, cache, tmp_path / "h",
               RunOptions(prompts=4, val_prompts=2, passages=1), progress=False, tokenizer=tok)


def test_the_draft_vocabulary_counts_the_labels_where_a_window_has_them(tmp_path):
    """A labelled window (passage, sampled answer) adds its greedy tokens from the
    last prompt row on, not its text; an answer's window adds its answer."""
    from specdecode.train.run import _eagle_setup
    target = tiny(5)
    h, layers = target.config.hidden_size, (0, 1)
    labelled = {"ids": torch.tensor([1, 2, 30, 30, 30, 30]), "aux": torch.zeros(5, 2 * h).half(),
                "answer_start": torch.tensor([2]), "start": torch.tensor([0]),
                "greedy": torch.tensor([-1, 7, 7, 7, 7])}
    answer = {"ids": torch.tensor([1, 2, 9, 9]), "aux": torch.zeros(3, 2 * h).half(),
              "answer_start": torch.tensor([2]), "start": torch.tensor([0])}
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    data.write_shard(paths[0], labelled)
    data.write_shard(paths[1], answer)
    options = RunOptions(drafter="eagle3", draft_vocab=2)
    head, wt, _, _, tokens = _eagle_setup(paths, paths[1:], target.embed_tokens.weight,
                                          target.lm_head.weight, (), target.config, layers,
                                          options)
    assert head.draft_ids.tolist() == [7, 9] and tokens == 4 + 2 and len(wt) == 2
