"""Replay recorded texts under variants of the free lookups' acceptance prior and caution.

    python bench/llama_cpp/prior_replay.py bench/results/agent-and-lookups.json \
        --curve bench/results/llama-cpp.json --curve bench/results/agent-zen3.json

The shipped default's lookups (n-gram and suffix, agent_replay.py's `auto`)
start each kind of draft at a prior acceptance (speclen.LengthPolicy.prior) and
learn the rest in hindsight. Where a two-token pass costs little (c(2) ~1.6),
an optimistic prior verifies drafts that text without repeats rejects, and a
short request has few steps to win that back. Each variant is replayed twice:
`cold`, every text on a fresh controller (a process's first request, as the
README's demo), and `warm`, the texts in the recorded order on one controller
(estimates carried, agent_replay.py's order and suffix-store rule). `--caution`
adds variants of the lower bound that prices free drafts' pooled positions
(speclen.LengthPolicy.priced; 0: the point estimate). `--online`: the
controllers learn the curve from the replayed passes (replay.py CurveClock) and
explore sizes not yet measured, as live (warm: learnt costs carry over too);
without it they decide on the curve alone. Reported
per curve and variant: predicted speedup per class (all tokens over all plain
steps) and, over the texts, the worst one and how many fall below 0.98x.
Predictions priced by each curve, not timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from agent_replay import NGRAM_MAX, Text, recorded_texts  # noqa: E402
from replay import replay_cost, shipped_controller  # noqa: E402

from specdecode import argtypes  # noqa: E402
from specdecode.controller import Controller  # noqa: E402
from specdecode.drafters import NgramDrafter  # noqa: E402
from specdecode.drafters.suffix import SuffixDrafter, SuffixStore  # noqa: E402
from specdecode.models import loading, registry  # noqa: E402
from specdecode.plan import DRAFTERS  # noqa: E402
from specdecode.speclen import CostModel  # noqa: E402

K = DRAFTERS["auto"].k[1]


Prior = tuple[float, float] | dict[int, tuple[float, float]] | None


def controller_for(curve: CostModel, prior: Prior, store: SuffixStore,
                   caution: float | None = None, online: bool = False) -> Controller:
    """The shipped lookups' controller (prior None), or with every kind's prior set to
    `prior` (a pair), or per kind ({kind: pair}; kind 0: the pooled estimate and any
    kind not named; default the policy's 90 %); caution: the policies' lower-bound z
    (speclen.LengthPolicy.priced; None: the shipped one); online: learn the curve from
    the replay's passes, exploring unmeasured sizes (replay.py CurveClock)."""
    lookups = [NgramDrafter(max_n=NGRAM_MAX), SuffixDrafter(store, max_n=NGRAM_MAX)]
    controller = shipped_controller(CostModel(curve.verify, 0.0), lookups, online)
    if caution is not None:
        for slot in controller.slots:
            slot.policy.caution = caution
    if prior is not None:
        by_kind = prior if isinstance(prior, dict) else {0: prior}
        for slot in controller.slots:
            slot.policy.prior = by_kind.get(0, slot.policy.prior)
            slot.kind_priors = {k: v for k, v in by_kind.items() if k}
    return controller


def replay_texts(texts: list[Text], curve: CostModel, prior: Prior,
                 cold: bool, vocab: int, eos: tuple[int, ...], caution: float | None = None,
                 online: bool = False) -> list[tuple[str, int, float]]:
    """(class, tokens, plain steps) per text, in order; cold: each text on a fresh
    controller and suffix store, else one controller throughout; caution and online
    as controller_for's."""
    store = SuffixStore()
    controller = controller_for(curve, prior, store, caution, online)
    out = []
    for text in texts:
        if cold:
            store = SuffixStore()
            controller = controller_for(curve, prior, store, caution, online)
        elif text.cold:
            store.clear()
        steps = replay_cost(text.prompt, text.output, None, None, curve, K, vocab, eos,
                            controller)
        out.append((text.cls.split(" turn")[0], len(text.output), steps))
    return out


def rows(texts: list[Text], curve_path: str, priors: list[Prior], vocab: int,
         eos: tuple[int, ...], cautions: list[float | None], online: bool = False
         ) -> list[str]:
    """Markdown rows for one curve file: per mode (cold, warm), prior and caution, the
    predicted speedup per class, the worst text and the count below 0.98x."""
    meta = json.loads(Path(curve_path).read_text())["meta"]
    curve = CostModel({int(b): c for b, c in meta["costs"]["c"].items()})
    label = f"{Path(curve_path).stem} (c(2) {curve.c(2):.2f}, c(5) {curve.c(5):.2f})"
    lines = []
    for mode in ("cold", "warm"):
        for prior, caution in ((p, c) for p in priors for c in cautions):
            per = replay_texts(texts, curve, prior, mode == "cold", vocab, eos, caution,
                               online)
            classes = list(dict.fromkeys(c for c, _, _ in per))
            rates = []
            for cls in classes:
                tokens = sum(n for c, n, _ in per if c == cls)
                steps = sum(s for c, _, s in per if c == cls)
                rates.append(f"{cls} {tokens / steps:.3f}")
            each = [n / s for _, n, s in per]
            low = sum(r < 0.98 for r in each)
            z = "shipped" if caution is None else f"{caution:g}"
            lines.append(f"| {label} | {mode} | {_label(prior)} | {z} | "
                         + "; ".join(rates) + f" | {min(each):.3f} | {low}/{len(each)} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def _parse_prior(text: str) -> Prior:
    """'shipped' -> None; '1.8/2' -> (1.8, 2.0); '0=1.8/2,1=1/2' -> {0: (1.8, 2.0),
    1: (1.0, 2.0)}."""
    if text == "shipped":
        return None
    if "=" not in text:
        return tuple(map(float, text.split("/")))
    return {int(k): tuple(map(float, v.split("/")))
            for k, v in (part.split("=") for part in text.split(","))}


def _label(prior: Prior) -> str:
    if prior is None:
        return "shipped (drafters/base.py MATCH_PRIORS)"
    if isinstance(prior, dict):
        return ",".join(f"{k}={a:g}/{t:g}" for k, (a, t) in prior.items())
    return f"{prior[0]:g}/{prior[1]:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="compare.py jsons whose texts to replay")
    ap.add_argument("--config", default="llama.cpp plain", help="whose texts to replay")
    ap.add_argument("--curve", action="append", required=True, help="a json with meta.costs.c")
    ap.add_argument("--prior", action="append", default=None,
                    help="shipped, or accepted/tried pseudo-counts for every kind (1.8/2), or per "
                         "kind (0=1.8/2,1=0.6/2; 0: pooled and kinds not named); repeatable")
    ap.add_argument("--caution", action="append", type=argtypes.non_negative_float,
                    default=None,
                    help="the lower bound's z for free drafts' pooled positions "
                         "(speclen.LengthPolicy.priced; default: the shipped one); repeatable")
    ap.add_argument("--online", action="store_true",
                    help="controllers learn the curve from the replay's passes and explore "
                         "unmeasured sizes, as live (default: decide on the curve alone)")
    ap.add_argument("--out", default=None, help="write the table here (markdown)")
    args = ap.parse_args()
    priors = [_parse_prior(p) for p in (args.prior or ["shipped"])]
    tok = loading.load_tokenizer(registry.resolve(registry.PAIRS["default"][0]))
    texts = [t for path in args.results
             for t in recorded_texts(json.loads(Path(path).read_text())["runs"], args.config,
                                     tok)]
    vocab = max(tok.vocab_size, *(max(t.prompt + t.output) + 1 for t in texts))
    eos = tuple(tok.eos_token_ids) or (vocab - 1,)
    head = [f"`{' '.join(sys.argv)}`\n",
            f"Texts: {args.config}'s greedy answers in {', '.join(args.results)} "
            f"({len(texts)} texts, {sum(len(t.output) for t in texts)} tokens).\n",
            "Prior `shipped`: drafters/base.py MATCH_PRIORS. Caution: z of the Wilson lower "
            "bound that prices a free draft's pooled positions (speclen.LengthPolicy.priced; "
            "0: the point estimate; `shipped`: LengthPolicy's default). "
            + ("`--online`: each controller learns the curve from the replay's passes "
               "(replay.py CurveClock) and explores sizes not yet measured, as live. "
               if args.online else "Controllers decide on the curve alone. ")
            + "Predictions priced by each curve, not timings (the machine does not enter).\n",
            "| curve | mode | prior | caution | predicted speedup per class | worst text | "
            "texts < 0.98x |", "|---|---|---|---|---|---|---|"]
    cautions = args.caution or [None]
    lines = [line for c in args.curve
             for line in rows(texts, c, priors, vocab, eos, cautions, args.online)]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
