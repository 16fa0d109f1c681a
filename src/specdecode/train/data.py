"""Self-distillation data for a hidden-state head: the target's own answers and states.

For each training prompt the target answers greedily (plain decoding, its
own tokens), and the final hidden state of every position that scored an
answer token is kept from the same passes (what the head sees when it
drafts). One shard per answer, `NNNNNN.safetensors` in the output folder
(collect_batched can add sampled answers to a prompt: `NNNNNN-sJ.safetensors`):
`tokens` [n] int64 (the answer a_0..a_{n-1}) and `hidden` [n, H] (row j: the
state at the position that scored a_j), float16. EAGLE-3 windows also keep the
target's distribution at every scored row as its SOFT_K most likely ids and
their log-probabilities (`top_ids`, `top_logp`: soft labels, eagle_fit.py). A
shard is written under a temporary name and renamed, so a killed run resumes at
the first missing one.

Prompts: only the sets the project trains on (TRAIN_SETS, from the shared prompt
folder beside the checkout); humaneval, mbpp and mt-bench are for measuring and
are refused. `docstring_prompts` makes prompts of the project's own from the
standard library's docstrings (no files needed).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.models.base import FINAL_LAYER

TRAIN_SETS = ("gsm8k", "livecodebench", "arena-hard-v2", "swe-bench")
HELD_OUT = ("humaneval", "mbpp", "mt-bench")
PROMPTS_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "prompts"
SOFT_K = 32  # target ids kept per row for soft labels (their probability mass: top_of)


def top_of(logits: torch.Tensor,  # [n, V]
           ) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, SOFT_K] int32, [n, SOFT_K] float16)
    """The target's SOFT_K most likely ids per row, most likely first, and their
    log-probabilities under softmax(logits) over the whole vocabulary (on the CPU)."""
    logits = logits.float()
    values, ids = logits.topk(min(SOFT_K, logits.shape[-1]), -1)
    logp = values - torch.logsumexp(logits, -1, keepdim=True)
    return ids.int().cpu(), logp.half().cpu()


def pad_top(tops: Sequence[tuple[torch.Tensor, torch.Tensor]],  # top_of parts, rows in order
            rows: int) -> dict[str, torch.Tensor]:
    """top_ids / top_logp: `rows` unscored rows (id -1, log-prob 0), then the parts'."""
    ids, logp = (torch.cat(part) for part in zip(*tops))
    return {"top_ids": torch.cat((torch.full((rows, ids.shape[1]), -1, dtype=ids.dtype), ids)),
            "top_logp": torch.cat((torch.zeros(rows, logp.shape[1], dtype=logp.dtype), logp))}


def training_prompts(sets: Sequence[str] = TRAIN_SETS, *, folder: Path = PROMPTS_DIR,
                     limit: int | None = None) -> list[str]:
    """First turns of the named prompt sets, interleaved (one of each in turn; a set
    that runs out drops out of the turn, the others go on)."""
    bad = [s for s in sets if s in HELD_OUT or s not in TRAIN_SETS]
    if bad:
        raise ValueError(f"{', '.join(bad)}: not a training set (train on "
                         f"{', '.join(TRAIN_SETS)}; {', '.join(HELD_OUT)} are for measuring)")
    per_set = []
    for name in sets:
        with open(folder / f"{name}.jsonl", encoding="utf-8") as f:
            per_set.append([json.loads(line)["turns"][0] for line in f if line.strip()])
    rounds = itertools.zip_longest(*per_set)
    mixed = [p for group in rounds for p in group if p is not None]
    return mixed[:limit]


def docstring_prompts(n: int, *, skip: int = 0) -> list[str]:
    """n prompts made from public functions' docstrings in a fixed list of
    standard-library modules ("Write a Python function ... that does: <doc>"),
    the first `skip` left out (a disjoint validation set: skip=n of another call)."""
    import importlib
    import inspect
    out = []
    for name in ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq", "statistics",
                 "string", "calendar", "difflib", "json", "base64", "html", "glob", "zipfile",
                 "csv", "pprint", "ipaddress", "fractions", "uuid"):
        module = importlib.import_module(name)
        for fname, fn in sorted(vars(module).items()):
            doc = inspect.getdoc(fn) if inspect.isfunction(fn) else None
            if fname.startswith("_") or not doc or len(doc) < 40:
                continue
            out.append(f"Write a Python function `{fname}` that does the following.\n\n"
                       f"{doc.split(chr(10) * 2)[0]}")
    return out[skip:skip + n]


@torch.no_grad()
def answer_with_states(target, prompt_ids: Sequence[int], max_new_tokens: int,
                       stop_ids: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy answer of the target to prompt_ids and the final hidden state that
    scored each answer token: ([n] int64, [n, H]); a prompt that leaves no room in
    the target's context gets none ([0], [0, 0])."""
    if len(prompt_ids) + 1 >= target.max_seq_len:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, 0)
    out = target.prefill(torch.tensor(list(prompt_ids)), hidden_layers=(FINAL_LAYER,))
    tokens, states, _ = _greedy(target, out, max_new_tokens, set(stop_ids), (FINAL_LAYER,),
                                soft=False)
    return torch.tensor(tokens, dtype=torch.long), torch.stack(states)


def _greedy(target, out, max_new_tokens: int, stop: set[int], layers: tuple[int, ...],
            soft: bool = True,
            ) -> tuple[list[int], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Greedy tokens from a prefill's output on, with the states (the `layers`
    concatenated, [H * len(layers)] float32) of the position that scored each and,
    with `soft`, that position's top_of ([1, SOFT_K] each)."""
    tokens, states, tops = [], [], []
    while len(tokens) < max_new_tokens:
        token = int(out.logits[-1].argmax())
        tokens.append(token)
        states.append(torch.cat([out.hidden_states[i][-1].float() for i in layers]))
        if soft:
            tops.append(top_of(out.logits[-1:]))
        if token in stop or target.cached_len + 1 >= target.max_seq_len:
            break
        out = target.forward(torch.tensor([token]), last_n=1, hidden_layers=layers)
    return tokens, states, tops


@torch.no_grad()
def answer_with_context(target, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: Iterable[int], layers: Sequence[int], context: int
                        ) -> dict[str, torch.Tensor]:
    """An EAGLE-3 shard: the target's greedy answer with the `layers` states
    (concatenated) of every position from the last `context` prompt positions on.
    ids [T + 1] int64: x_s .. x_{s+T} (prompt tail + answer but its last token's
    state); aux [T, H * len(layers)] float16: row p the states at x_{s+p} (which
    scored x_{s+p+1}); answer_start [1]: index in ids of the answer's first token;
    start [1]: s, the window's first position; top_ids / top_logp [T, SOFT_K]: the
    target's distribution at each row from the prompt's last on (top_of; earlier
    rows -1 / 0). Empty (T = 0) when no room."""
    layers, prompt = tuple(layers), list(prompt_ids)
    if len(prompt) + 1 >= target.max_seq_len or len(prompt) < 2:
        return empty_shard(context)
    out = target.prefill(torch.tensor(prompt), hidden_layers=layers, hidden_all=True)
    s = max(0, len(prompt) - context)
    head = torch.cat([out.hidden_states[i][s:].float() for i in layers], -1)  # [P - s, LH]
    tokens, states, tops = _greedy(target, out, max_new_tokens, set(stop_ids), layers)
    return _context_shard(prompt, s, head, tokens, torch.stack(states), tops)


def _context_shard(prompt: list[int], s: int, head: torch.Tensor,  # [P - s, LH]
                   tokens: list[int], states: torch.Tensor,  # [n, LH]
                   tops: Sequence[tuple[torch.Tensor, torch.Tensor]],  # n x top_of [1, K]
                   ) -> dict[str, torch.Tensor]:
    """answer_with_context's tensors from the prompt states kept from position s and
    the answer's tokens with the states that scored them and their top_of."""
    aux = torch.cat((head[:-1], states))  # states of x_s .. x_{P+n-2}
    return {"ids": torch.tensor(prompt[s:] + tokens, dtype=torch.long), "aux": aux.half(),
            "answer_start": torch.tensor([len(prompt) - s]), "start": torch.tensor([s]),
            **pad_top(tops, len(head) - 1)}


def draw(logits: torch.Tensor, temperature: float,  # logits: [V]
         gen: torch.Generator) -> int:
    """A token drawn from softmax(logits / temperature) by inverting its CDF with one
    uniform of `gen` (float64 sums). torch.multinomial draws one random number per
    vocabulary entry: ~4 ms per token for a 152k vocabulary here, against ~1 ms."""
    cdf = torch.softmax(logits.double() / temperature, -1).cumsum(0)  # [V]
    u = torch.rand((), generator=gen, dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(cdf) - 1)


@dataclass
class _Answer:
    """One answer being written in a batch: its prompt's index, which answer of the
    prompt (`sample`: 0 the greedy one), its handle (a sequence of the target),
    ids, the kept prompt states (eagle3: [P - s, LH]), the tokens so far with the
    states that scored each ([LH] float32), and for a sampled answer its seeded
    generator and the target's greedy token at each of its rows (`greedy`); eagle3:
    each row's top_of (`top`)."""

    index: int
    handle: object
    prompt: list[int]
    start: int
    head: torch.Tensor | None
    sample: int = 0
    gen: torch.Generator | None = None
    temperature: float = 1.0
    tokens: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)
    greedy: list[int] = field(default_factory=list)
    top: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    done: bool = False

    def take(self, out, layers: tuple[int, ...], stop: set[int], max_new_tokens: int) -> None:
        """Append the next token of a pass's last row (greedy, or drawn from the
        target's distribution at `temperature` with a generator) and its state."""
        logits = out.logits[-1]  # [V]
        best = int(logits.argmax())
        token = best if self.gen is None else draw(logits, self.temperature, self.gen)
        self.tokens.append(token)
        self.greedy.append(best)
        self.states.append(torch.cat([out.hidden_states[i][-1].float() for i in layers]))
        if self.head is not None:
            self.top.append(top_of(logits[None]))
        self.done = (token in stop or len(self.tokens) >= max_new_tokens
                     or self.handle.cached_len + 1 >= self.handle.max_seq_len)

    def shard(self) -> dict[str, torch.Tensor]:
        """The shard's tensors: eagle3's (answer_with_context) when prompt states
        were kept, else the hidden head's (answer_with_states). A sampled answer's
        also holds `greedy` [T] int64: row p's greedy token (-1 on prompt rows
        before the last: not scored), what training labels it with."""
        states = torch.stack(self.states)
        if self.head is None:
            return {"tokens": torch.tensor(self.tokens, dtype=torch.long),
                    "hidden": states.half()}
        shard = _context_shard(self.prompt, self.start, self.head, self.tokens, states, self.top)
        if self.gen is not None:
            shard["greedy"] = torch.tensor([-1] * (len(self.head) - 1) + self.greedy,
                                           dtype=torch.long)
        return shard


@dataclass(frozen=True)
class BatchPlan:
    """How collect_batched answers: `size` answers at once (one pass steps them
    all: on a backend whose batched passes cost about one plain step that is
    ~size times the tokens/s), the states of `layers`, `context` prompt positions
    kept before each answer (None: a hidden-head shard, no prompt states), a
    deadline (time.monotonic(); no new prompt is started after it), and `samples`
    answers per prompt: the greedy one, then samples - 1 drawn at `temperature`
    (eagle3 shards only), all from one prefill of the prompt (its cache copied):
    the prompt's cost is shared by more answer tokens."""

    size: int
    layers: tuple[int, ...] = (FINAL_LAYER,)
    context: int | None = None
    deadline: float | None = None
    samples: int = 1
    temperature: float = 0.8

    def __post_init__(self) -> None:
        if self.samples < 1 or self.temperature <= 0:
            raise ValueError("samples must be >= 1 and temperature > 0")
        if self.samples > 1 and (self.context is None or self.size < self.samples):
            raise ValueError(f"{self.samples} answers per prompt need eagle3 shards "
                             f"(a context) and a batch of at least {self.samples}")


def shard_path(out_dir: Path, index: int, sample: int) -> Path:
    """Prompt `index`'s answer `sample`: NNNNNN.safetensors for the greedy one (0),
    NNNNNN-sJ.safetensors for sampled answer J."""
    return out_dir / (f"{index:06d}.safetensors" if sample == 0
                      else f"{index:06d}-s{sample}.safetensors")


def _open_answers(target, free: list, index: int, ids: list[int], missing: list[int],
                  plan: BatchPlan, stop: set[int], max_new_tokens: int) -> list[_Answer] | None:
    """Prefill a prompt on a free handle and start its `missing` answers (each on a
    handle of its own, the prefill's cache copied there) with their first token
    (None: no room, nothing taken from `free`)."""
    eagle = plan.context is not None
    if len(ids) + 1 >= target.max_seq_len or (eagle and len(ids) < 2):
        return None
    handle = free.pop()
    out = handle.prefill(torch.tensor(ids), hidden_layers=plan.layers, hidden_all=eagle)
    start = max(0, len(ids) - plan.context) if eagle else 0
    head = (torch.cat([out.hidden_states[i][start:].float() for i in plan.layers], -1)
            if eagle else None)
    snap = handle.snapshot() if len(missing) > 1 else None
    answers = []
    for n, sample in enumerate(missing):
        if n:
            handle = free.pop()
            handle.restore(snap)
        gen = None if sample == 0 else torch.Generator().manual_seed(index * 1009 + sample)
        answer = _Answer(index, handle, ids, start, head, sample, gen, plan.temperature)
        answer.take(out, plan.layers, stop, max_new_tokens)
        answers.append(answer)
    return answers


@torch.no_grad()
def collect_batched(target, encode: Callable[[str], list[int]], prompts: Sequence[str],
                    out_dir: str | Path, plan: BatchPlan, *, max_new_tokens: int = 256,
                    stop_ids: Iterable[int] = (), order: Sequence[int] | None = None,
                    greedy_only: Collection[int] = (), progress: bool = True) -> list[Path]:
    """collect's shards, `plan.size` answers at once: each answer runs on a sequence
    handle of the target (target.sequence(i)) and every pass steps all open answers
    by one token (target.forward_many). Greedy as alone up to the rounding of a
    pass of another shape (a near-tie can go the other way: the answer is still
    the target's own). order: which prompts first (default: in turn); prompts not
    reached by plan.deadline get no shard; greedy_only: prompts answered only
    greedily (validation). Returns every path (shard_path), per prompt in order:
    the greedy answer's, then its sampled answers'."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    greedy_only = set(greedy_only)
    wanted = [[shard_path(out_dir, i, j) for j in range(1 if i in greedy_only else plan.samples)]
              for i in range(len(prompts))]
    missing = {i: [j for j, p in enumerate(ps) if not p.is_file()] for i, ps in enumerate(wanted)}
    todo = [i for i in (range(len(prompts)) if order is None else order) if missing[i]]
    total = sum(len(missing[i]) for i in todo)
    todo = iter(todo)
    free, open_, stop = [target.sequence(i) for i in range(plan.size)], [], set(stop_ids)
    pending = None
    with CollectBar(progress, total) as advance:
        while True:
            while plan.deadline is None or time.monotonic() < plan.deadline:
                pending = next(todo, None) if pending is None else pending
                if pending is None or len(free) < len(missing[pending]):
                    break
                opened = _open_answers(target, free, pending, encode(prompts[pending]),
                                       missing[pending], plan, stop, max_new_tokens)
                for j in missing[pending] if opened is None else ():
                    write_shard(wanted[pending][j], empty_shard(plan.context))
                    advance(0)
                open_ += opened or []
                pending = None
            if not open_:
                return [p for ps in wanted for p in ps]
            _step(target, [a for a in open_ if not a.done], plan, stop, max_new_tokens)
            for a in [a for a in open_ if a.done]:
                write_shard(wanted[a.index][a.sample], a.shard())
                advance(len(a.tokens))
                open_.remove(a)
                free.append(a.handle)


def _step(target, running: list[_Answer], plan: BatchPlan, stop: set[int],
          max_new_tokens: int) -> None:
    """One batched pass stepping every running answer by its last token."""
    if not running:
        return
    outs = target.forward_many([(a.handle, torch.tensor(a.tokens[-1:])) for a in running],
                               last_n=1, hidden_layers=plan.layers)
    for a, out in zip(running, outs):
        a.take(out, plan.layers, stop, max_new_tokens)


def empty_shard(context: int | None) -> dict[str, torch.Tensor]:
    """A prompt with no room: a hidden-head shard (context None) or an eagle3 one."""
    if context is None:
        return {"tokens": torch.zeros(0, dtype=torch.long), "hidden": torch.zeros(0, 0).half()}
    return {"ids": torch.zeros(1, dtype=torch.long), "aux": torch.zeros(0, 0).half(),
            "answer_start": torch.tensor([1]), "start": torch.tensor([0])}


def write_shard(path: Path, shard: dict[str, torch.Tensor]) -> None:
    """Write a shard under a temporary name, then rename it (a killed run resumes)."""
    from safetensors.torch import save_file
    tmp = path.with_suffix(".part")
    save_file(shard, str(tmp))
    tmp.rename(path)


def collect(target, encode: Callable[[str], list[int]], prompts: Sequence[str],
            out_dir: str | Path, *, max_new_tokens: int = 256, stop_ids: Iterable[int] = (),
            progress: bool = True,
            answer: Callable[[list[int]], dict[str, torch.Tensor]] | None = None,
            ) -> list[Path]:
    """Answer every prompt (encode: prompt -> chat-formatted ids) into out_dir's
    shards, skipping shards already written; returns all shard paths in order.
    answer: ids -> the shard's tensors (default: a hidden-head shard, `tokens` and
    `hidden` of answer_with_states)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{i:06d}.safetensors" for i in range(len(prompts))]
    todo = [i for i, p in enumerate(paths) if not p.is_file()]
    stop_ids = tuple(stop_ids)

    def hidden_head_shard(ids: list[int]) -> dict[str, torch.Tensor]:
        tokens, hidden = answer_with_states(target, ids, max_new_tokens, stop_ids)
        return {"tokens": tokens, "hidden": hidden.half()}

    answer = answer or hidden_head_shard
    with CollectBar(progress, len(todo)) as advance:
        for i in todo:
            shard = answer(encode(prompts[i]))
            write_shard(paths[i], shard)
            n = len(shard["tokens"]) if "tokens" in shard else int(
                len(shard["ids"]) - shard["answer_start"][0])
            advance(n)
    return paths


def load_shards(paths: Sequence[Path]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens [n] int64, hidden [n, H] float32) per shard."""
    from safetensors.torch import load_file
    out = []
    for p in paths:
        t = load_file(str(p))
        out.append((t["tokens"], t["hidden"].float()))
    return out


class CollectBar:
    """A rich progress bar over prompts with answer tokens/s over the wall time since
    it started (nothing when off)."""

    def __init__(self, on: bool, total: int, label: str = "collecting answers") -> None:
        self.on, self.total, self.tokens, self.label = on, total, 0, label
        self.started = time.perf_counter()

    def __enter__(self) -> Callable[[int], None]:
        if not self.on:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn(self.label), BarColumn(),
                            TextColumn("{task.completed}/{task.total} prompts"),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                            console=Console(stderr=True))  # stdout: the JSON summary
        self.task = self.bar.add_task("collect", total=self.total, rate="")
        self.bar.start()
        self.started = time.perf_counter()
        return self._advance

    def _advance(self, n: int) -> None:
        self.tokens += n
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.update(self.task, advance=1, rate=f"{self.tokens} tokens, {rate:.1f} tok/s")

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self.bar.stop()


class StepBar:
    """A rich progress bar over training steps with answer tokens/s and the time
    left (nothing when off); its callable is fit.fit's on_step."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> Callable[[int, int, int], None] | None:
        if not self.on:
            return None
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        self.bar = Progress(TextColumn("training"), BarColumn(),
                            TextColumn("{task.completed}/{task.total} steps"),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                            console=Console(stderr=True))  # stdout: the JSON summary
        self.task = self.bar.add_task("train", total=None, rate="")
        self.bar.start()
        self.started = time.perf_counter()
        return self._advance

    def _advance(self, step: int, total: int, seen: int) -> None:
        rate = seen / max(time.perf_counter() - self.started, 1e-9)
        self.bar.update(self.task, completed=step, total=total,
                        rate=f"{seen} tokens seen, {rate:.0f} tok/s")

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self.bar.stop()
