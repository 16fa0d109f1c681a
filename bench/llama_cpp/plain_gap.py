"""Plain decoding: llama-server vs specdecode's llama.cpp forward loop, one after the other.

    python bench/llama_cpp/plain_gap.py

Same build, GGUF, prompt ids (HumanEval/0), 128 greedy tokens, EOS ignored,
flash attention off and the weights read into memory, in 2 MiB pages, on both sides.
llama-server's decoding speed is its own `predicted_per_second` (also checked
against the request's wall time minus its prompt time); ours is a bare loop of
one-token `LlamaCppLM.forward` calls and argmax, no engine. A diagnostic for
the plain-step gap in compare.py's table. One heavy process: run nothing else.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from compare import Server  # noqa: E402

from specdecode.bench import workloads  # noqa: E402
from specdecode.models import llama_cpp_build, loading, registry  # noqa: E402
from specdecode.models.llama_cpp import LlamaCppLM  # noqa: E402


def main(repeats: int = 2, n: int = 128) -> None:
    os.environ.setdefault("SPECDECODE_FLASH_ATTN", "off")  # as compare.py: off on both sides
    tools = llama_cpp_build.build()
    target = registry.resolve("default")
    ids = workloads.humaneval(1)[0].ids(loading.load_tokenizer(target))
    server = Server("llama.cpp plain", [])
    server.start(tools, target, 4096, 2)
    try:
        server.complete(ids[:64], 8, 0.0, 0)  # warm-up
        for _ in range(repeats):
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": True,
                    "ignore_eos": True}
            req = urllib.request.Request(f"http://127.0.0.1:{server.port}/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            start = time.perf_counter()
            with urllib.request.urlopen(req) as r:
                t = json.loads(r.read())["timings"]
            wall = time.perf_counter() - start - t["prompt_ms"] / 1000
            print(f"llama-server: {t['predicted_per_second']:.2f} tok/s "
                  f"(wall minus prompt: {t['predicted_n'] / wall:.2f})")
    finally:
        server.stop()
    model = LlamaCppLM(target, max_seq_len=4096)
    for _ in range(repeats):
        model.prefill(torch.tensor(ids[:-1]))
        token, start = ids[-1], time.perf_counter()
        for _ in range(n):
            token = int(model.forward(torch.tensor([token])).logits[-1].argmax())
        print(f"LlamaCppLM loop: {n / (time.perf_counter() - start):.2f} tok/s")


if __name__ == "__main__":
    main()
