"""The agent workload: multi-turn trajectories, each turn's prompt the conversation so
far (earlier prompts + the model's own answers) plus a new user turn.

How the trajectories are made (all material is real, nothing is invented text):
- code agent, one per file (`AGENT_FILES`, small standard-library modules other
  than code-edit's): turn 1 shows the file as a tool's read of it and asks for an
  edit; turn 2 is the real output of `grep -n "def "` over the file (a tool
  result) with a follow-up request; turn 3 is the real `help()` text of one of its
  functions (pydoc, as `python -c "help(...)"` prints it) with a last request.
  Every turn asks for code that restates what the conversation already holds, as
  coding agents do (read, edit, re-read, check).
- chat: the two-turn conversations of MT-bench (../shared/data/prompts/mt-bench.jsonl),
  whose second turns ask to revise or discuss the first answer.
The answers are the model's own, made while the benchmark runs: each
configuration decodes its own trajectory, turn after turn (bench/runner.py).
"""

from __future__ import annotations

import importlib
import json
import pydoc
from pathlib import Path

AGENT_FILES = (("fnmatch.py", "translate"), ("genericpath.py", "commonprefix"),
               ("linecache.py", "getlines"))
MT_BENCH = Path(__file__).resolve().parents[4] / "shared" / "data" / "prompts" / "mt-bench.jsonl"
SYSTEM = ("You are a coding agent. You read files through tools, and you reply with "
          "complete code blocks.")


def grep_defs(source: str) -> str:
    """What `grep -n "def " FILE` prints."""
    return "\n".join(f"{i}:{line}" for i, line in enumerate(source.splitlines(), 1)
                     if "def " in line)


def help_text(module: str, function: str) -> str:
    """What `python -c "import M; help(M.f)"` prints (pydoc's plain text)."""
    obj = getattr(importlib.import_module(module), function)
    return pydoc.render_doc(obj, renderer=pydoc.plaintext).strip()


def code_trajectory(file: str, function: str, source: str) -> tuple[tuple[dict, ...],
                                                                      tuple[str, ...]]:
    """(first messages, follow-up user turns) of one code-agent trajectory."""
    module = file.removesuffix(".py")
    first = (f"Tool result (read_file {file}):\n```python\n{source}```\n\n"
             f"Add type hints to `{function}` and to every function it calls in this file. "
             "Reply with the updated functions in one code block.")
    second = (f"Tool result (grep -n \"def \" {file}):\n```\n{grep_defs(source)}\n```\n\n"
              "Now add a one-line docstring to each function listed above that has none. "
              "Reply with those functions in one code block.")
    third = (f"Tool result (python -c \"import {module}; help({module}.{function})\"):\n"
             f"```\n{help_text(module, function)}\n```\n\n"
             f"Make the docstring of `{function}` say what this help text says, and reply "
             f"with the whole function `{function}` in one code block.")
    return ({"role": "system", "content": SYSTEM}, {"role": "user", "content": first}), (
        second, third)


def mt_bench_turns(limit: int) -> list[list[str]]:
    """The first `limit` MT-bench conversations (user turns), where the file is present."""
    if not MT_BENCH.exists():
        return []
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    return [row["turns"] for row in rows[:limit]]
