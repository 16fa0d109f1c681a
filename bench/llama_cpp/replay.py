"""Replay n-gram speculation on recorded outputs: our shipped control vs llama.cpp's ngram-mod rule.

    python bench/llama_cpp/replay.py bench/results/llama-cpp.json

compare.py measures each configuration on its own output, and at T > 0 every
configuration samples its own text (llama.cpp and specdecode draw different
random numbers), so a row there mixes the drafter's merit with the luck of
what was sampled: a sample that restates the prompt's function speeds up 2x,
one that does not, not at all. This script takes the texts out of the
comparison: it runs every recorded output (each configuration's, each prompt,
seed and temperature) through the real engine twice, once with specdecode's
shipped n-gram control (the n-gram slot of `llm.make_controller`, deciding on
the run's curve alone, estimates carried from text to text in the recorded
order) and once with llama.cpp's ngram-mod rule (a 24-token match,
drafts of 48 to 64 tokens, otherwise none: common/speculative.cpp), against
a target that emits the recorded text, and prices each verification pass with
the cost curve c(b) measured in that run.

Predicted speedup over plain decoding = tokens / sum of c(pass size) over the
passes. At T > 0 a point-mass draft token is accepted with probability
p(token), the chance that the target's sample is that token; accepting exactly
when the recorded sample equals the draft has that expectation, so replaying
the sampled text prices a draft as the sampler would on average.
Predictions, not timings: the engine's glue and llama.cpp's scheduling are
not in them (compare.py measures those).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter as time_now

import torch

from specdecode.bench import workloads
from specdecode.controller import Controller
from specdecode.drafters import NgramDrafter
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixStore
from specdecode.engine import SpeculativeDecoder
from specdecode.llm import make_controller
from specdecode.models import loading, registry
from specdecode.models.base import ForwardOutput
from specdecode.sampling import SamplingParams
from specdecode.speclen import CostModel, LengthPolicy


class CurveClock:
    """A clock that only the replayed target's passes advance, each by its price on
    `curve` (c(b) plain steps; one plain step = one unit): an online controller
    learns exactly the curve, and its exploration of unmeasured sizes happens as
    it would live, without timing noise."""

    def __init__(self, curve: CostModel) -> None:
        self.curve, self.now = curve, 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, b: int) -> None:
        self.now += self.curve.c(b)


class RecordedLM:
    """A CausalLM that predicts a recorded text: at each position its logits are
    one-hot on the recorded next token. Counts the size of every forward pass
    (and advances `clock`, if given, by its price)."""

    def __init__(self, sequence: list[int], vocab_size: int, eos: tuple[int, ...],
                 clock: CurveClock | None = None) -> None:
        self.sequence, self.vocab_size, self.eos_token_ids = sequence, vocab_size, eos
        self.max_seq_len = len(sequence) + 128
        self.passes: list[int] = []
        self._len = 0
        self.clock = clock

    device = torch.device("cpu")
    dtype = torch.float32

    @property
    def cached_len(self) -> int:
        return self._len

    def rollback(self, length: int) -> None:
        self._len = length

    def prefill(self, ids: torch.Tensor) -> ForwardOutput:  # ids: [T] int64
        self._len = 0
        out = self.forward(ids, last_n=1)
        self.passes.clear()  # prefill is not priced
        return out

    def forward(self, ids: torch.Tensor, *, last_n: int | None = None,  # ids: [T] int64
                return_hidden: bool = False, positions=None, tree_mask=None) -> ForwardOutput:
        t = int(ids.shape[0])
        n = t if last_n is None else last_n
        self.passes.append(t)
        if self.clock is not None:
            self.clock.advance(t)
        start, self._len = self._len, self._len + t
        logits = torch.zeros(n, self.vocab_size)  # [n, vocab_size]
        for row, pos in enumerate(range(start + t - n, start + t)):
            nxt = pos + 1
            token = self.sequence[nxt] if nxt < len(self.sequence) else self.eos_token_ids[0]
            logits[row, token] = 1.0
        return ForwardOutput(logits)


class NgramModRule:
    """llama.cpp's ngram-mod drafting (common/speculative.cpp, default settings):
    the next token after each earlier `n_match`-gram; a draft chains these
    lookups from the context's last n_match tokens and is proposed only if at
    least n_min long (at most n_max); the server then cuts it to the tokens
    left to generate."""

    name = "ngram-mod"

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64) -> None:
        self.n_match, self.n_min, self.n_max = n_match, n_min, n_max
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def begin(self, prompt_ids, params, generator) -> None:
        self._next, self._indexed = {}, 0

    def propose(self, ctx) -> Draft:
        context, k = ctx.tokens, ctx.k
        n = self.n_match
        for i in range(self._indexed, len(context) - n):
            self._next[tuple(context[i:i + n])] = context[i + n]
        self._indexed = max(self._indexed, len(context) - n)
        window, draft = list(context[-n:]), []
        while len(draft) < self.n_max:  # judged at full length, then cut to k (as llama.cpp)
            token = self._next.get(tuple(window[-n:]))
            if token is None:
                break
            draft.append(token)
            window.append(token)
        if len(draft) < self.n_min:
            draft = []
        return Draft(torch.tensor(draft[:k], dtype=torch.long))

    def observe(self, num_accepted: int) -> None:
        pass


def shipped_controller(curve: CostModel, lookups: Sequence[Drafter], online: bool = False
                       ) -> Controller:
    """The free-lookup side of the shipped default (llm.make_controller) with the
    `lookups` drafters (n-gram, suffix or both), deciding on the run's curve alone
    (online=False: exploration off) or learning it from a CurveClock (online):
    per-kind acceptance, estimates carried between the texts replayed in order."""
    slots = make_controller(curve, lookups, None).slots
    return Controller(slots, curve, online=online)


def predicted_speedup(prompt: list[int], output: list[int], drafter, costs: CostModel | None,
                      curve: CostModel, k: int, vocab: int, eos: tuple[int, ...],
                      controller: Controller | None = None) -> float:
    """Tokens per plain-step cost when `drafter` (with a length policy if costs is
    given; or the `controller`'s drafters) speculates on a target that emits
    `output` after `prompt`."""
    return len(output) / replay_cost(prompt, output, drafter, costs, curve, k, vocab, eos,
                                     controller)


def replay_cost(prompt: list[int], output: list[int], drafter, costs: CostModel | None,
                curve: CostModel, k: int, vocab: int, eos: tuple[int, ...],
                controller: Controller | None = None) -> float:
    """Plain steps (the passes priced by `curve`) that predicted_speedup's replay spends
    emitting `output`; AssertionError if the replay does not reproduce it. An online
    `controller` (Controller(online=True)) learns the curve from a CurveClock."""
    online = controller is not None and controller.costs is not None
    clock = CurveClock(curve) if online else None
    target = RecordedLM(prompt + output, vocab, eos, clock)
    policy = LengthPolicy(costs) if costs is not None else None
    decoder = (SpeculativeDecoder(target, k=k, controller=controller, clock=clock or time_now)
               if controller else SpeculativeDecoder(target, drafter, k, length_policy=policy))
    params = SamplingParams(temperature=0.0, max_tokens=len(output), ignore_eos=True)
    result = decoder.generate(prompt, params)
    assert result.token_ids == output, "the replay must reproduce the recorded text"
    return sum(curve.c(b) for b in target.passes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a compare.py (or bench/never_slower.py) json")
    ap.add_argument("--k", type=int, default=64, help="specdecode's draft cap (LLM.load's)")
    ap.add_argument("--ngram-max", type=int, default=8, help="LLM.load's adaptive default")
    ap.add_argument("--suffix", action="store_true",
                    help="also replay the suffix drafter (its store fills text by text)")
    args = ap.parse_args()

    data = json.loads(Path(args.results).read_text())
    curve = CostModel({int(b): c for b, c in data["meta"]["costs"]["c"].items()})
    target = registry.resolve(registry.PAIRS["default"][0])
    tok = loading.load_tokenizer(target)
    prompts = {p.name: p for w in dict.fromkeys(r["workload"] for r in data["runs"])
               for p in workloads.load(w, 99)}
    vocab = max(tok.vocab_size, *(max(r["tokens"], default=0) + 1 for r in data["runs"]),
                *(max(p.ids(tok)) + 1 for p in prompts.values()))
    eos = tuple(tok.eos_token_ids) or (vocab - 1,)
    texts: dict[tuple, list] = {}  # (workload, T, prompt, text) -> configs that sampled it
    for r in data["runs"]:
        if "/turn" in r["prompt"]:  # a trajectory's later turn: its prompt is not recorded
            continue
        key = (r["workload"], r.get("temperature", 0), r["prompt"], tuple(r["tokens"]))
        texts.setdefault(key, []).append(r.get("config") or r["mode"])
    free = CostModel(curve.verify, 0.0)
    controller = shipped_controller(free, [NgramDrafter(max_n=args.ngram_max)])
    suffix = shipped_controller(free, [SuffixDrafter(SuffixStore())]) if args.suffix else None
    rows: dict[tuple, list] = {}
    for (workload, temp, name, text), configs in texts.items():
        prompt = prompts[name].ids(tok)
        ours = predicted_speedup(prompt, list(text), None, None, curve, args.k, vocab, eos,
                                 controller)
        mod = predicted_speedup(prompt, list(text), NgramModRule(), None, curve, 64, vocab, eos)
        suf = suffix and predicted_speedup(prompt, list(text), None, None, curve, args.k, vocab,
                                           eos, suffix)
        rows.setdefault((workload, temp), []).append((ours, mod, suf or 0.0))
        print(f"{name:20} T={temp:<4} {len(text):4} tokens  specdecode {ours:5.2f}x  "
              f"ngram-mod {mod:5.2f}x" + (f"  suffix {suf:5.2f}x" if suffix else "")
              + f"  (sampled by {', '.join(configs)})", file=sys.stderr)
    _table(rows, suffix is not None)
    return 0


def _table(rows: dict[tuple, list], suffix: bool) -> None:
    extra = " specdecode suffix drafter (store across texts) |" if suffix else ""
    print("| workload | T | texts | specdecode shipped n-gram control | llama.cpp ngram-mod rule | "
          f"texts where ours is ahead |{extra}\n|---|---|---|---|---|---|" + ("---|" * suffix))
    for (workload, temp), triples in rows.items():
        ours, mod, suf = zip(*triples, strict=True)
        ahead = sum(o > m for o, m, _ in triples)
        print(f"| {workload} | {temp:g} | {len(triples)} | {statistics.median(ours):.2f}x | "
              f"{statistics.median(mod):.2f}x | {ahead}/{len(triples)} |"
              + (f" {statistics.median(suf):.2f}x |" if suffix else ""))


if __name__ == "__main__":
    sys.exit(main())
