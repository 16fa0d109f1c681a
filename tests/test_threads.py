"""threads.py: one thread policy for the process, decided from the backends loaded."""

from __future__ import annotations

import pytest
import torch

from specdecode import threads


def test_plan_per_backend_mix():
    assert threads.plan({"llama.cpp"}, 4) == threads.ThreadPlan(1, 4)
    assert threads.plan({"torch"}, 4) == threads.ThreadPlan(4, 4)
    # a torch draft beside a llama.cpp target keeps torch's threads
    assert threads.plan({"llama.cpp", "torch"}, 4) == threads.ThreadPlan(4, 4)
    assert threads.plan(set(), 2).torch_threads == 2
    with pytest.raises(ValueError, match="unknown backend"):
        threads.plan({"onnx"})


def test_loaded_applies_the_union(monkeypatch):
    monkeypatch.setattr(threads, "_loaded", set())
    monkeypatch.setattr(threads, "cpus", lambda: 2)
    before = torch.get_num_threads()
    try:
        assert threads.loaded("llama.cpp") == threads.ThreadPlan(1, 2)
        assert torch.get_num_threads() == 1
        assert threads.loaded("torch") == threads.ThreadPlan(2, 2)  # the draft came later
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_llama_cpp_constructor_leaves_torch_threads_alone():
    """The llama.cpp model no longer sets torch's threads for the process."""
    from specdecode.models import llama_cpp

    if not llama_cpp.available():
        pytest.skip("llama.cpp is not built (specdecode build-llama-cpp)")
    import real

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = llama_cpp.LlamaCppLM(real.path("smollm2-135m"), max_seq_len=64)
        assert torch.get_num_threads() == 2
        assert model.n_threads == threads.llama_threads()
        model.close()
    finally:
        torch.set_num_threads(before)
