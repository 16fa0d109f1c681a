"""The process's thread policy: one place decides torch's and llama.cpp's thread counts.

Model constructors set no process-wide state; whoever loads models calls `loaded(backend)`
once per model, and the policy for the set of backends loaded so far is applied:

- llama.cpp threads: every CPU this process may run on, for 1-token steps and batches
  (a llama.cpp model asks `llama_threads()` unless given its own counts).
- torch threads: 1 when only llama.cpp models are loaded: torch then only samples
  (argmax, softmax over logits) between llama.cpp calls, and its OpenMP threads spinning
  beside llama.cpp's slowed plain decoding 13 % on 2 cores. With a torch model loaded
  (a torch target, or a torch draft beside a llama.cpp target) torch keeps all CPUs: its
  model runs between llama.cpp calls, never at the same time.

`plan` is pure (testable); `apply` sets torch's count only when it changes it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

import torch

BACKENDS = ("torch", "llama.cpp")
_loaded: set[str] = set()


@dataclass(frozen=True)
class ThreadPlan:
    torch_threads: int
    llama_threads: int


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan(backends: Collection[str], n_cpus: int | None = None) -> ThreadPlan:
    """The thread counts for a process with models of these backends loaded."""
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backend(s) {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    n = n_cpus or cpus()
    only_llama = "llama.cpp" in backends and "torch" not in backends
    return ThreadPlan(torch_threads=1 if only_llama else n, llama_threads=n)


def apply(p: ThreadPlan) -> None:
    """Set torch's thread count to the plan's (llama.cpp reads its count per model)."""
    if torch.get_num_threads() != p.torch_threads:
        torch.set_num_threads(p.torch_threads)


def loaded(backend: str) -> ThreadPlan:
    """Record that a model of `backend` is loaded and apply the plan for all loaded."""
    _loaded.add(backend)
    p = plan(_loaded)
    apply(p)
    return p


def llama_threads() -> int:
    """Threads a llama.cpp model uses when not told otherwise."""
    return plan({"llama.cpp"}).llama_threads
