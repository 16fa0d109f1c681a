"""Replay recorded texts, agent trajectories included, priced by several machines' cost curves.

    python bench/llama_cpp/agent_replay.py bench/results/auto-both-lookups.json \
        --curve bench/results/llama-cpp.json --curve /tmp/this-run.json

compare.py times each configuration on its own trajectory, on one machine, with
a +-10 % spread between runs. This script asks what the drafting alone is worth
on the same texts under each machine's cost curve c(b) (plain steps to verify
b tokens, from the `meta.costs` of each json given): every recorded answer of
one configuration (`--config`, default llama.cpp plain), each agent turn with
its prompt rebuilt as compare.py built it (the conversation so far with that
configuration's own answers), is replayed in the recorded order against a
target that emits the recorded text (replay.py's RecordedLM), with:
- `auto`: the shipped default's lookups (n-gram and suffix, the suffix store
  shared by all texts as a process's is; llm.make_controller, deciding on the
  curve alone: replay.py's shipped_controller);
- `ngram` / `suffix`: each of the two lookups alone under the same control;
- `ngram-mod`: llama.cpp's rule (replay.py's NgramModRule; per request);
- `hindsight`: the same two lookups' drafts, each step cut to the length that
  pays most knowing how much of it the target accepts (no draft where none
  pays): what a perfect length choice over these drafters gives;
- `ceiling`: the exact continuation drafted at the best length each step:
  the most any drafter could give with this curve.

Predicted speedup over plain decoding = tokens / sum of c(pass size) over all
passes of a class (as compare.py's rates: all tokens over all time). Greedy
texts only. Predictions, not timings: the engine's glue and llama.cpp's
scheduling are not in them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from replay import NgramModRule, RecordedLM, shipped_controller  # noqa: E402

from specdecode.bench import workloads  # noqa: E402
from specdecode.drafters import NgramDrafter  # noqa: E402
from specdecode.drafters.base import Draft, DraftContext  # noqa: E402
from specdecode.drafters.suffix import SuffixDrafter, SuffixStore  # noqa: E402
from specdecode.engine import SpeculativeDecoder  # noqa: E402
from specdecode.models import loading, registry  # noqa: E402
from specdecode.sampling import SamplingParams  # noqa: E402
from specdecode.speclen import CostModel  # noqa: E402

K = 64  # the adaptive default's draft cap (LLM.load)
NGRAM_MAX = 8  # the adaptive default's n-gram length


class Hindsight:
    """The lookups' drafts cut, each step, to the length that pays most given how much
    of each the recorded text accepts (ties: the longer)."""

    name = "hindsight"

    def __init__(self, lookups: list, sequence: list[int], curve: CostModel) -> None:
        self.lookups, self.sequence, self.curve = lookups, sequence, curve

    def begin(self, prompt_ids, params, generator) -> None:
        for lookup in self.lookups:
            lookup.begin(prompt_ids, params, generator)

    def propose(self, ctx: DraftContext) -> Draft:
        truth = self.sequence[len(ctx.tokens):len(ctx.tokens) + ctx.k]
        best, best_rate = [], 1.0
        for lookup in self.lookups:
            tokens = lookup.propose(ctx).tokens.tolist()
            right = next((i for i, (a, b) in enumerate(zip(tokens, truth)) if a != b),
                         min(len(tokens), len(truth)))
            for n in range(1, right + 1):
                rate = (n + 1) / self.curve.c(n + 1)
                if rate >= best_rate:
                    best, best_rate = tokens[:n], rate
        return Draft(torch.tensor(best, dtype=torch.long))

    def observe(self, num_accepted: int) -> None:
        for lookup in self.lookups:
            lookup.observe(num_accepted)

    def finish(self, output_ids: list[int]) -> None:
        for lookup in self.lookups:
            if getattr(lookup, "finish", None) is not None:
                lookup.finish(output_ids)


def ceiling_cost(n: int, curve: CostModel) -> float:
    """Plain steps to emit n tokens drafting the exact continuation at the best length."""
    cost, left = 0.0, n
    while left > 0:
        b = max(range(1, min(K + 1, left) + 1), key=lambda b: b / curve.c(b))
        cost, left = cost + curve.c(b), left - b
    return cost


def replay(texts: list[tuple[str, list[int], list[int]]], policy: str, curve: CostModel,
           vocab: int, eos: tuple[int, ...]) -> dict[str, list[float]]:
    """{class: [tokens, plain steps]} over `texts` (class, prompt, output) replayed in
    order with one policy; the suffix store lives across the texts."""
    free = CostModel(curve.verify, 0.0)
    store = SuffixStore()
    lookups = [NgramDrafter(max_n=NGRAM_MAX), SuffixDrafter(store, max_n=NGRAM_MAX)]
    controlled = {"auto": lookups, "ngram": lookups[:1], "suffix": lookups[1:]}.get(policy)
    controller = shipped_controller(free, controlled) if controlled else None
    out: dict[str, list[float]] = {}
    for cls, prompt, output in texts:
        tally = out.setdefault(cls, [0, 0.0])
        tally[0] += len(output)
        if policy == "ceiling":
            tally[1] += ceiling_cost(len(output), curve)
            continue
        target = RecordedLM(prompt + output, vocab, eos)
        if controller is not None:
            decoder = SpeculativeDecoder(target, k=K, controller=controller)
        else:
            drafter = (NgramModRule() if policy == "ngram-mod"
                       else Hindsight(lookups, prompt + output, curve))
            decoder = SpeculativeDecoder(target, drafter, K if policy == "hindsight" else 64)
        params = SamplingParams(temperature=0.0, max_tokens=len(output), ignore_eos=True)
        result = decoder.generate(prompt, params)
        assert result.token_ids == output, "the replay must reproduce the recorded text"
        tally[1] += sum(curve.c(b) for b in target.passes)
    return out


def recorded_texts(runs: list[dict], config: str, tok) -> list[tuple[str, list[int], list[int]]]:
    """(class, prompt ids, output ids) of one configuration's greedy runs, in the
    recorded order; a trajectory's turn prompt rebuilt from its earlier answers."""
    prompts = {p.name: p for w in dict.fromkeys(r["workload"] for r in runs)
               for p in workloads.load(w, 99)}
    answers: dict[str, list[str]] = {}
    texts = []
    for r in runs:
        if r.get("config", r.get("mode")) != config or r.get("temperature", 0) != 0:
            continue
        name = r["prompt"].split("/turn")[0]
        p, earlier = prompts[name], answers.setdefault(name, [])
        ids = p.turn_ids(tok, earlier) if p.followups else p.ids(tok)
        turn = r.get("turn", 1)
        cls = f"{r['workload']} turn {turn}" if p.followups else r["workload"]
        texts.append((cls, ids, list(r["tokens"])))
        earlier.append(tok.decode(r["tokens"]))
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a compare.py json (its texts and its curve)")
    ap.add_argument("--config", default="llama.cpp plain", help="whose texts to replay")
    ap.add_argument("--curve", action="append", default=None,
                    help="a json with meta.costs.c and meta.cpu (repeatable; default: results)")
    ap.add_argument("--out", default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    data = json.loads(Path(args.results).read_text())
    tok = loading.load_tokenizer(registry.resolve(registry.PAIRS["default"][0]))
    texts = recorded_texts(data["runs"], args.config, tok)
    vocab = max(tok.vocab_size, *(max(p + o) + 1 for _, p, o in texts))
    eos = tuple(tok.eos_token_ids) or (vocab - 1,)
    policies = ("auto", "ngram", "suffix", "ngram-mod", "hindsight", "ceiling")
    lines = [f"`{' '.join(sys.argv)}`\n", f"Texts: {args.config}'s in {args.results} "
             f"({len(texts)} texts, {sum(len(o) for *_, o in texts)} tokens).\n",
             "| curve (machine, c(17), c(65)) | class | tokens | "
             + " | ".join(policies) + " |", "|---|---|---|" + "---|" * len(policies)]
    for path in args.curve or [args.results]:
        meta = json.loads(Path(path).read_text())["meta"]
        curve = CostModel({int(b): c for b, c in meta["costs"]["c"].items()})
        label = f"{Path(path).stem} ({meta.get('cpu', '?')}, {curve.c(17):.1f}, {curve.c(65):.1f})"
        results = {p: replay(texts, p, curve, vocab, eos) for p in policies}
        for cls in [*results["auto"], "all agent turns"]:
            rates = []
            for p in policies:
                tallies = ([v for c, v in results[p].items() if c.startswith("agent")]
                           if cls == "all agent turns" else [results[p][cls]])
                tokens, steps = map(sum, zip(*tallies, strict=True))
                rates.append(f"{tokens / steps:.2f}x")
            lines.append(f"| {label} | {cls} | {tokens:.0f} | " + " | ".join(rates) + " |")
        print("\n".join(lines[-len(results['auto']) - 1:]), file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
