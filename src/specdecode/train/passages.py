"""Teacher-forced passages: text the target did not write, labelled with its greedy tokens.

Collecting the target's own answers runs at ~40 answer tokens/s on 2 CPU cores
(one decode pass per token, and each prompt's prefill); one teacher-forced pass
over a request and a given answer scores every answer position at once, at the
speed of a prefill. A passage window holds the target's states along the given
text and, as its labels, the target's own greedy token at every row (the
`greedy` field of a sampled answer's shard, data.py): the token a draft must hit
after that prefix, whatever the text goes on with. The text is the project's
own choice from what ships with Python (no file or network needed, never a
measuring set): functions' source as the answer to a request made from their
docstring, and the language reference's prose (pydoc_data) as the answer to a
request to explain a topic, in turn. The list follows the Python that runs it
(1,047 code passages on 3.11.7): shards are named by position, so a cache is
for one Python version.
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from specdecode.train import data

# Pure-Python standard-library modules whose public functions and methods are
# taken as code passages (a fixed list, so the passages do not change between runs).
CODE_MODULES = (
    "textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq", "statistics", "string",
    "calendar", "difflib", "json.decoder", "json.encoder", "base64", "html", "glob",
    "zipfile", "csv", "pprint", "ipaddress", "fractions", "uuid", "argparse", "gettext",
    "configparser", "dataclasses", "enum", "functools", "inspect", "ast", "tokenize",
    "email.utils", "email.message", "urllib.parse", "http.cookies", "shutil", "tempfile",
    "pathlib", "posixpath", "locale", "logging", "logging.handlers", "optparse", "plistlib",
    "quopri", "random", "sched", "secrets", "smtplib", "stringprep", "tarfile", "timeit",
    "traceback", "turtle", "typing", "unittest.case", "wave", "weakref", "zipapp",
    "collections", "contextlib", "copy", "datetime", "decimal", "fileinput", "netrc",
    "operator", "pickletools", "queue", "reprlib", "selectors", "subprocess", "threading",
)
MAX_SOURCE_CHARS = 4000
PROSE_CHARS = 1500


def code_passages() -> Iterator[tuple[str, str]]:
    """(request, answer): "Write a Python function `name` ... <docstring's first
    paragraph>" and the function's source in a fenced block, for every public
    function and method with a docstring of 40+ characters in CODE_MODULES."""
    seen = set()
    for name in CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for fname, fn in _functions(module):
            doc = inspect.getdoc(fn)
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if not doc or len(doc) < 40 or len(source) > MAX_SOURCE_CHARS or source in seen:
                continue
            seen.add(source)
            request = (f"Write a Python function `{fname}` that does the following.\n\n"
                       f"{doc.split(chr(10) * 2)[0]}")
            yield request, f"```python\n{textwrap.dedent(source).rstrip()}\n```"


def _functions(module) -> Iterator[tuple[str, Callable]]:
    """Public functions of a module and public methods of its public classes defined
    there, in name order."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for mname, meth in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(meth):
                    yield mname, meth


def prose_passages() -> Iterator[tuple[str, str]]:
    """(request, answer): "Explain <topic> in Python." and a part of at most
    PROSE_CHARS characters (whole paragraphs) of the language reference's text for
    the topic (pydoc_data.topics), each part of a long topic on its own."""
    from pydoc_data.topics import topics
    for key in sorted(topics):
        title = key.replace("-", " ")
        part = ""
        for para in topics[key].split("\n\n"):
            if part and len(part) + len(para) > PROSE_CHARS:
                yield f"Explain {title} in Python.", part.strip()
                part = ""
            part += para + "\n\n"
        if part.strip():
            yield f"Explain {title} in Python.", part.strip()


def passages(n: int) -> list[tuple[str, str]]:
    """The first n passages, code and prose in turn (one that runs out drops out)."""
    out, sources = [], [code_passages(), prose_passages()]
    while len(out) < n and sources:
        for source in list(sources):
            item = next(source, None)
            if item is None:
                sources.remove(source)
            elif len(out) < n:
                out.append(item)
    return out


@torch.no_grad()
def teacher_forced(target, prompt_ids: Sequence[int], answer_ids: Sequence[int],
                   layers: Sequence[int], context: int) -> dict[str, torch.Tensor]:
    """A window over a request and a given answer in one pass of the target: the
    tensors of data.answer_with_context (ids, aux, answer_start, start) with
    `greedy` [T] int64, the target's greedy token at each row (-1 on prompt rows
    before the last), and its distribution there (top_ids / top_logp, data.top_of).
    Empty (data's empty shard) when the two do not fit the target's context, the
    prompt has under 2 tokens or the answer none."""
    prompt, answer, layers = list(prompt_ids), list(answer_ids), tuple(layers)
    ids = prompt + answer
    if len(ids) + 1 >= target.max_seq_len or len(prompt) < 2 or not answer:
        return data.empty_shard(context)
    target.rollback(0)  # an empty cache, then the whole text
    out = target.forward(torch.tensor(ids), last_n=len(answer) + 1, hidden_layers=layers,
                         hidden_all=True)
    s = max(0, len(prompt) - context)
    aux = torch.cat([out.hidden_states[i][s:-1].float() for i in layers], -1)  # [T, LH]
    best = out.logits[:-1].argmax(-1).cpu()  # [A] rows of positions P-1 .. P+A-2
    greedy = torch.cat((torch.full((len(prompt) - 1 - s,), -1, dtype=torch.long), best))
    return {"ids": torch.tensor(ids[s:], dtype=torch.long), "aux": aux.half(),
            "answer_start": torch.tensor([len(prompt) - s]), "start": torch.tensor([s]),
            "greedy": greedy, **data.pad_top([data.top_of(out.logits[:-1])], len(prompt) - 1 - s)}


def collect(target, encode: Callable[[str], list[int]], encode_text: Callable[[str], list[int]],
            items: Sequence[tuple[str, str]], out_dir: str | Path, layers: Sequence[int],
            *, context: int, max_answer_tokens: int, progress: bool = True) -> list[Path]:
    """teacher_forced windows of `items` ((request, answer); encode: request ->
    chat-formatted ids ending in the assistant's header; encode_text: answer -> ids,
    cut to max_answer_tokens) into out_dir's shards NNNNNN.safetensors, skipping
    those written (a killed run resumes); returns every path in order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{i:06d}.safetensors" for i in range(len(items))]
    todo = [i for i, p in enumerate(paths) if not p.is_file()]
    with data.CollectBar(progress, len(todo), "teacher-forcing passages") as advance:
        for i in todo:
            request, answer = items[i]
            shard = teacher_forced(target, encode(request),
                                   encode_text(answer)[:max_answer_tokens], layers, context)
            data.write_shard(paths[i], shard)
            advance(int(len(shard["ids"]) - shard["answer_start"][0]))
    return paths
