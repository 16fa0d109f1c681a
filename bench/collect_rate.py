"""Where `specdecode train`'s answer collection spends its time: prompt rows/s of a
lone prefill against rows/s of one batched decode pass (torch backend, default target).

    python bench/collect_rate.py

Prefills of 100, 300 and 500 random-token prompts (three each, keeping the EAGLE-3
layers' states of every position, as train/data.collect_batched does), then 64
sequences holding a 300-token prompt each are stepped by one token, 16, 32 and 64
of them per pass (best of three passes after one untimed). Prints one line per
measurement; the rates bound what collection can reach: answer tokens/s <=
1 / (prompt_tokens_per_answer_token / prefill_rate + 1 / decode_rate).
"""

from __future__ import annotations

import time

import torch

from specdecode.costs import cpu_name
from specdecode.drafters.eagle import Eagle3Config
from specdecode.llm import LLM
from specdecode.options import LoadSpec


def main() -> None:
    llm = LLM.from_spec(LoadSpec(target="default", backend="torch", drafter="none",
                                 max_seq_len=2048))
    target = llm.decoder.target
    layers = Eagle3Config.default_layers(target.config.num_layers)
    seqs = [target.sequence(i) for i in range(64)]
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads")
    for n in (100, 300, 500):
        for seq in seqs[:3]:
            ids = torch.randint(100, 20000, (n,), generator=gen)  # [n] int64
            start = time.perf_counter()
            seq.prefill(ids, hidden_layers=layers, hidden_all=True)
            print(f"prefill {n} tokens: {n / (time.perf_counter() - start):.1f} rows/s")
    for seq in seqs:
        seq.prefill(torch.randint(100, 20000, (300,), generator=gen), hidden_layers=layers)
    for rows in (16, 32, 64):
        times = []
        for _ in range(4):
            start = time.perf_counter()
            target.forward_many([(s, torch.tensor([5])) for s in seqs[:rows]], last_n=1,
                                hidden_layers=layers)
            times.append(time.perf_counter() - start)
        best = min(times[1:])
        print(f"decode pass of {rows} rows: {best:.3f} s, {rows / best:.1f} rows/s")


if __name__ == "__main__":
    main()
