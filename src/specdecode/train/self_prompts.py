"""Prompts the target writes itself: chat coverage the training sets lack.

The training sets (data.TRAIN_SETS) are maths, code and technical requests; a
head trained on them alone drafts poorly on writing, role-play or humanities
questions. Here the target continues its own chat template's user turn (the
template's text up to where a user message's content starts, then one of
OPENINGS, the project's generic openings of a request) and samples until the
template's end-of-turn token: the requests it is most used to answering, spread
over kinds of task by the openings. One seeded generator per prompt index, so a
prompt does not depend on the batch it was written in (up to the rounding of a
pass of another shape). The prompts are kept in a JSONL file that a run asking
for more appends to, so earlier prompts keep their position; the answers a run
keeps for them are named by that position (delete the two together).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from specdecode.train.data import draw

# Generic openings of a request, one per prompt in turn ("" leaves the request to
# the target). Written for this project, after the kinds of task a chat model is
# asked (writing, role-play, reasoning, extraction, STEM, humanities, advice);
# none is taken from a measuring set.
OPENINGS = (
    "", "Write a short story about", "Write a poem about", "Compose an email to",
    "Draft a blog post about", "Imagine you are", "Act as", "Explain", "Describe",
    "Summarize", "What are the pros and cons of", "Compare", "Give me advice on",
    "How can I", "Why do", "What is the difference between", "Help me plan",
    "Suggest", "List", "Rewrite the following", "Discuss", "What were the causes of",
    "In physics,", "How does", "Extract", "Suppose", "Write a persuasive essay on",
    "Create a dialogue between", "What would happen if", "Tell me about",
    "Write a speech for", "Brainstorm",
)
MARK = "\u2063specdecode-user-content\u2063"


class ChatTokenizer(Protocol):
    """What writing prompts needs of a tokenizer (text.Tokenizer has it): the
    Hugging Face tokenizer with its chat template, the control tokens' texts, decode."""

    hf: object
    control_tokens: frozenset[str]

    def decode(self, ids: Sequence[int]) -> str: ...


def user_turn(tokenizer: ChatTokenizer) -> tuple[str, int]:
    """(the chat template's rendering of a conversation up to the first user
    message's content, its default system turn included; the control token id
    that ends a user message). ValueError for a template that does not show a
    user message's content as given, or ends it in plain text (`[/INST]`-style
    markup the target would write and decoding would drop)."""
    text = tokenizer.hf.apply_chat_template([{"role": "user", "content": MARK}],
                                            tokenize=False, add_generation_prompt=False)
    if text.count(MARK) != 1:
        raise ValueError("this chat template does not show a user message as given: "
                         "it cannot write its own prompts")
    before, after = text.split(MARK)
    end = tokenizer.hf.encode(after, add_special_tokens=False)[:1]
    if not end or tokenizer.hf.convert_ids_to_tokens(end[0]) not in tokenizer.control_tokens:
        raise ValueError("this chat template does not end a user message with a control "
                         "token: it cannot write its own prompts")
    return before, end[0]


def load(path: Path) -> list[str]:
    """The prompts kept in `path`, in order (none when it is absent)."""
    return [r["prompt"] for r in _records(path) if r["prompt"] is not None]


def _records(path: Path) -> list[dict]:
    """Every index tried in `path`: {index, opening, prompt (None: dropped)}. A last
    line cut short by a killed run is dropped (and cut from the file)."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    records = []
    for n, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines) - 1:
                raise ValueError(f"{path}: line {n + 1} is not JSON") from None
            path.write_text("".join(lines[:n]), encoding="utf-8")
    return records


Writer = Callable[[list[int]], list[str | None]]


def ensure(target, tokenizer: ChatTokenizer, path: Path, n: int, *, batch: int = 16,
           max_tokens: int = 96, temperature: float = 1.0, stop_ids: Iterable[int] = (),
           writer: Writer | None = None) -> list[str]:
    """The first n prompts of `path`, writing missing ones `batch` indices at a time
    (appended, a JSON object per line: index, opening, prompt; every kept prompt
    of a batch is written, so the file does not depend on the n asked for). A
    request that does not end within max_tokens, or is empty or repeated, is
    dropped (prompt null). After 4 n + batch indices tried, what was kept is
    returned, maybe fewer than n. writer: indices -> requests (default: write)."""
    records = _records(path)
    have = [r["prompt"] for r in records if r["prompt"] is not None]
    index = max((r["index"] for r in records), default=-1) + 1
    writer = writer or (lambda todo: write(target, tokenizer, todo, max_tokens=max_tokens,
                                           temperature=temperature, stop_ids=stop_ids))
    while len(have) < n and index < 4 * n + batch:
        todo = list(range(index, index + batch))
        lines = []
        for i, text in zip(todo, writer(todo), strict=True):
            keep = text is not None and text not in have
            lines.append(json.dumps({"index": i, "opening": OPENINGS[i % len(OPENINGS)],
                                     "prompt": text if keep else None}) + "\n")
            have += [text] if keep else []
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(lines))
        index += batch
    return have[:n]


@torch.no_grad()
def write(target, tokenizer: ChatTokenizer, indices: list[int], *, max_tokens: int,
          temperature: float, stop_ids: Iterable[int] = ()) -> list[str | None]:
    """One request per index, all sampled in step (one pass over the weights per
    token, a sequence handle each): its opening and what the target wrote after it
    up to the end of its user turn (user_turn's token, or one of stop_ids), decoded
    together (None: no end within max_tokens, or nothing written)."""
    before, end = user_turn(tokenizer)
    stop = {end, *stop_ids}
    prefix = tokenizer.hf.encode(before, add_special_tokens=False)  # the template's markup
    running = []
    for n, i in enumerate(indices):
        opening = tokenizer.hf.encode(OPENINGS[i % len(OPENINGS)], add_special_tokens=False)
        handle = target.sequence(n)
        gen = torch.Generator().manual_seed(7919 * i + 17)
        out = handle.prefill(torch.tensor(prefix + opening))
        running.append((handle, gen, opening, [draw(out.logits[-1], temperature, gen)]))
    while live := [r for r in running if r[3][-1] not in stop and len(r[3]) < max_tokens]:
        outs = target.forward_many([(h, torch.tensor(t[-1:])) for h, _, _, t in live],
                                   last_n=1)
        for (_, gen, _, tokens), out in zip(live, outs):
            tokens.append(draw(out.logits[-1], temperature, gen))
    texts = []
    for _, _, opening, tokens in running:
        body = tokens[:-1] if tokens[-1] in stop else []
        written = tokenizer.decode(body).strip()
        texts.append(tokenizer.decode(opening + body).strip() if written else None)
    return texts
