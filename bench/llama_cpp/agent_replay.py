"""Replay recorded texts, agent trajectories included, priced by several machines' cost curves.

    python bench/llama_cpp/agent_replay.py bench/results/auto-both-lookups.json \
        --curve bench/results/llama-cpp.json --curve bench/results/agent-zen3.json

compare.py times each configuration on its own trajectory, on one machine, with
a +-10 % spread between its processes. This script asks what the drafting alone
is worth on the same texts under each machine's cost curve c(b) (plain steps to
verify b tokens, from the `meta.costs` of each json given): every greedy
answer of one configuration (`--config`, default llama.cpp plain), each agent
turn with its prompt rebuilt as compare.py built it (the conversation so far
with that configuration's own answers), is replayed in the recorded order
against a target that emits the recorded text (replay.py's RecordedLM). As in
compare.py, the suffix store is emptied before every cold request (a
single-turn prompt, a trajectory's first turn) and kept across a trajectory's
turns. Policies:
- `auto`: the shipped default's lookups (n-gram and suffix; llm.make_controller,
  deciding on the curve alone: replay.py's shipped_controller);
- `ngram` / `suffix`: each of the two lookups alone under the same control;
- `ngram-mod`: llama.cpp's rule (replay.py's NgramModRule; per request);
- `hindsight`: the two lookups' proposals at every position, verified in the
  passes that cost least over the whole text knowing how much of each proposal
  the text confirms (`fewest_steps`): the best any choice of when and how long
  to verify these drafts can do (passes that would carry rejected tokens are
  left out, which only matters where the curve is not monotone);
- `ceiling`: the same with every position's continuation right for K tokens:
  the most any drafter could give with this curve and the draft cap K.

Predicted speedup = tokens / sum of the passes' c(b) over all texts of a class
(as compare.py's rates: all tokens over all time), relative to plain decoding
on the same engine (c(1) = 1). Predictions, not timings: the engine's glue,
llama.cpp's scheduling and the machine's noise are not in them, and the
baseline is the engine's own plain step, not llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from replay import NgramModRule, replay_cost, shipped_controller  # noqa: E402

from specdecode.bench import workloads  # noqa: E402
from specdecode.drafters import NgramDrafter  # noqa: E402
from specdecode.drafters.base import DraftContext, Drafter  # noqa: E402
from specdecode.drafters.suffix import SuffixDrafter, SuffixStore  # noqa: E402
from specdecode.models import loading, registry  # noqa: E402
from specdecode.plan import DRAFTERS  # noqa: E402
from specdecode.plan import NGRAM_MAX as PLAN_NGRAM_MAX  # noqa: E402
from specdecode.sampling import SamplingParams  # noqa: E402
from specdecode.speclen import CostModel  # noqa: E402

POLICIES = ("auto", "ngram", "suffix", "ngram-mod", "hindsight", "ceiling")
K = DRAFTERS["auto"].k[1]  # the adaptive default's draft cap (src/specdecode/plan.py)
NGRAM_MAX = PLAN_NGRAM_MAX[1]  # the adaptive default's n-gram length


@dataclass
class Text:
    """One recorded answer: its class, prompt and output ids, and whether its request
    started cold (compare.py empties the cache and the suffix store before it)."""

    cls: str
    prompt: list[int]
    output: list[int]
    cold: bool = True


def fewest_steps(n: int, curve: CostModel, accepted: list[int]) -> float:
    """Least plain-step cost of emitting n tokens when at output position i a pass of b
    tokens (b <= K + 1 and b <= n - i, as the engine's budget allows) emits all b
    only if b - 1 <= accepted[i] (the draft tokens a lookup had right there);
    dynamic programming over positions, so the best split, not a greedy one."""
    best = [0.0] * (n + 1)  # best[i]: cost from output position i to the end
    for i in range(n - 1, -1, -1):
        most = min(K + 1, n - i, accepted[i] + 1)
        best[i] = min(curve.c(b) + best[i + b] for b in range(1, most + 1))
    return best[0]


def accepted_drafts(lookups: list[Drafter], prompt: list[int], output: list[int]
                    ) -> list[int]:
    """At each output position, the most draft tokens any of `lookups` proposed there
    that the recorded output confirms (the lookups see the text as the engine would
    give it to them, one position after another; then the request's finish)."""
    params = SamplingParams(temperature=0.0, max_tokens=len(output), ignore_eos=True)
    for lookup in lookups:
        lookup.begin(prompt, params, None)
    out = []
    for i in range(len(output)):
        k = min(K, len(output) - i - 1)  # the engine's budget at this step
        ctx = DraftContext(prompt + output[:i], k, params, prompt_len=len(prompt))
        confirmed = 0
        for lookup in lookups if k > 0 else []:
            draft = lookup.propose(ctx).tokens.tolist()[:k]
            truth = output[i:i + len(draft)]  # a draft proposes output[i], output[i+1], ...
            confirmed = max(confirmed, next((j for j, (a, b) in enumerate(zip(draft, truth))
                                             if a != b), len(draft)))
        out.append(confirmed)
    for lookup in lookups:
        lookup.finish(list(output))
    return out


def recorded_texts(runs: list[dict], config: str, tok) -> list[Text]:
    """One configuration's greedy answers in the recorded order; a trajectory's turn
    prompt rebuilt from its earlier answers (`tok`: the target's tokenizer; each
    prompt's length is checked against the one recorded)."""
    prompts = {p.name: p for w in dict.fromkeys(r["workload"] for r in runs)
               for p in workloads.load(w, 99)}
    answers: dict[str, list[str]] = {}
    texts = []
    for r in runs:
        if r.get("config", r.get("mode")) != config or r.get("temperature", 0) != 0:
            continue
        name, turn = r["prompt"].split("/turn")[0], r.get("turn", 1)
        p = prompts[name]
        if turn == 1:
            answers[name] = []
        ids = p.turn_ids(tok, answers[name]) if p.followups else p.ids(tok)
        if "prompt_tokens" in r and len(ids) != r["prompt_tokens"]:
            raise ValueError(f"{r['prompt']}: rebuilt prompt has {len(ids)} tokens, the run "
                             f"recorded {r['prompt_tokens']} (another Python's stdlib?)")
        cls = f"{r['workload']} turn {turn}" if p.followups else r["workload"]
        texts.append(Text(cls, ids, list(r["tokens"]), cold=turn == 1))
        answers[name].append(tok.decode(r["tokens"]))
    return texts


def replay(texts: list[Text], policy: str, curve: CostModel, vocab: int,
           eos: tuple[int, ...]) -> dict[str, list[float]]:
    """{class: [tokens, plain steps]} over `texts` replayed in order with one policy
    (POLICIES); the suffix store is emptied at every cold text, as compare.py does."""
    store = SuffixStore()
    lookups = [NgramDrafter(max_n=NGRAM_MAX), SuffixDrafter(store, max_n=NGRAM_MAX)]
    controlled = {"auto": lookups, "ngram": lookups[:1], "suffix": lookups[1:]}.get(policy)
    controller = (shipped_controller(CostModel(curve.verify, 0.0), controlled)
                  if controlled else None)
    out: dict[str, list[float]] = {}
    for text in texts:
        if text.cold:
            store.clear()
        tally = out.setdefault(text.cls, [0, 0.0])
        tally[0] += len(text.output)
        tally[1] += _cost(text, policy, curve, controller, lookups, vocab, eos)
    return out


def _cost(text: Text, policy: str, curve: CostModel, controller, lookups: list[Drafter],
          vocab: int, eos: tuple[int, ...]) -> float:
    """Plain steps one policy spends on one text."""
    n = len(text.output)
    if policy == "ceiling":
        return fewest_steps(n, curve, [K] * n)
    if policy == "hindsight":
        return fewest_steps(n, curve, accepted_drafts(lookups, text.prompt, text.output))
    if controller is not None:
        return replay_cost(text.prompt, text.output, None, None, curve, K, vocab, eos,
                           controller)
    rule = NgramModRule()
    return replay_cost(text.prompt, text.output, rule, None, curve, rule.n_max, vocab, eos)


def table(texts: list[Text], curves: list[str], vocab: int, eos: tuple[int, ...]
          ) -> list[str]:
    """Markdown rows: per curve file and class, each policy's predicted speedup (and
    all agent turns together where there are any)."""
    lines = []
    for path in curves:
        meta = json.loads(Path(path).read_text())["meta"]
        curve = CostModel({int(b): c for b, c in meta["costs"]["c"].items()})
        label = (f"{Path(path).stem} ({meta.get('cpu', '?')}, {curve.c(17):.1f}, "
                 f"{curve.c(65):.1f})")
        results = {p: replay(texts, p, curve, vocab, eos) for p in POLICIES}
        classes = list(results["auto"])
        agent = [c for c in classes if c.startswith("agent")]
        for cls in classes + (["all agent turns"] if agent else []):
            rates = []
            for p in POLICIES:
                tallies = [results[p][c] for c in (agent if cls == "all agent turns" else [cls])]
                tokens, steps = map(sum, zip(*tallies, strict=True))
                rates.append(f"{tokens / steps:.2f}x")
            lines.append(f"| {label} | {cls} | {tokens:.0f} | " + " | ".join(rates) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


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
    vocab = max(tok.vocab_size, *(max(t.prompt + t.output) + 1 for t in texts))
    eos = tuple(tok.eos_token_ids) or (vocab - 1,)
    head = [f"`{' '.join(sys.argv)}`\n",
            f"Texts: {args.config}'s in {args.results} ({len(texts)} texts, "
            f"{sum(len(t.output) for t in texts)} tokens).\n",
            "| curve (machine, c(17), c(65)) | class | tokens | " + " | ".join(POLICIES) + " |",
            "|---|---|---|" + "---|" * len(POLICIES)]
    text = "\n".join(head + table(texts, args.curve or [args.results], vocab, eos)) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
