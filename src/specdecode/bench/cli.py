"""`specdecode bench` and `specdecode advise`: their flags and what they print."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from specdecode.argtypes import (
    choice_list,
    float_list,
    int_list,
    non_negative_float,
    non_negative_int,
    positive_int,
    seed,
)
from specdecode.bench import workloads
from specdecode.options import LoadSpec

# Load options a bench or advise run sets per configuration itself (its rows), not by flag.
ROW_OPTIONS = ("drafter", "k", "adaptive")


def _common(p: argparse.ArgumentParser, add_load_args,
            without: tuple[str, ...] = ROW_OPTIONS) -> None:
    add_load_args(p, without)
    p.add_argument("--workload", "-w", action="append", default=None, dest="workloads",
                   help=f"{', '.join(workloads.NAMES)} or a .jsonl file (repeatable)")
    p.add_argument("--limit", type=positive_int, default=None, help="prompts per workload")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def add_parsers(sub, add_load_args) -> None:
    """`bench` and `advise`; `add_load_args` is the CLI's one definition of the load
    options (cli.py), of which each run sets drafter, k and adaptive per row itself."""
    p = sub.add_parser("bench", help="benchmark plain, drafters and peers side by side")
    _common(p, add_load_args)
    p.add_argument("--max-tokens", "-n", type=positive_int, default=128)
    p.add_argument("--drafters", type=choice_list(("auto", "draft-model", "ngram", "suffix",
                                                    "eagle3", "hidden-head")),
                   default=["auto", "draft-model", "ngram"],
                   help="comma-separated; auto is the shipped default, as `LLM.load` gives it "
                        "(default: auto,draft-model,ngram; suffix: drafters/suffix.py, k as "
                        "--ngram-k; eagle3 / hidden-head: the trained head of --head, k as -k)")
    p.add_argument("-k", "--num-speculative-tokens", type=int_list, default=[8],
                   dest="draft_k", help="k values for the draft model, e.g. 4,8 (default 8)")
    p.add_argument("--ngram-k", type=int_list, default=[16],
                   help="k values for n-gram and suffix lookup (default 16)")
    p.add_argument("--temperatures", type=float_list, default=[0.0, 0.7],
                   help="comma-separated (default 0,0.7)")
    p.add_argument("--peers", type=choice_list(("hf", "none")), default=["hf"],
                   help="hf (transformers plain / assisted / prompt lookup) or none")
    p.add_argument("--prompt-lookup-k", type=positive_int, default=10,
                   help="HF prompt_lookup_num_tokens (default 10)")
    p.add_argument("--repeats", type=positive_int, default=1)
    p.add_argument("--background-load", type=non_negative_int, default=0, metavar="N",
                   help="N busy processes compete for the CPU during the measured runs")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", default="specdecode-bench",
                   help="writes OUT.json, OUT.md and OUT-*.png (default: specdecode-bench)")
    p.add_argument("--no-plots", action="store_true")

    p = sub.add_parser("advise", help="measure costs and acceptance; recommend drafter and k")
    # advise drafts at each drafter's longest k without confidence stops: no --draft-confidence
    _common(p, add_load_args, (*ROW_OPTIONS, "draft_confidence"))
    p.add_argument("--max-tokens", "-n", type=positive_int, default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--max-draft-k", type=positive_int, default=12)
    p.add_argument("--max-ngram-k", type=positive_int, default=24)


def _check_workloads(names: list[str], limit: int | None) -> None:
    for name in names:  # fail on a bad workload before loading any model
        workloads.load(name, limit)


def cmd_bench(args, spec: LoadSpec) -> int:
    """Run `specdecode bench`: every row on the load options of `spec` (cli.load_spec)."""
    from specdecode.bench import report
    from specdecode.bench.runner import BenchOptions, run

    names = args.workloads or ["humaneval", "code-edit"]
    _check_workloads(names, args.limit)
    options = BenchOptions(
        **BenchOptions.load_fields(spec), workloads=names, limit=args.limit,
        max_tokens=args.max_tokens, drafters=args.drafters, draft_k=args.draft_k,
        ngram_k=args.ngram_k, temperatures=args.temperatures,
        peers=[p for p in args.peers if p != "none"], repeats=args.repeats,
        warmup=not args.no_warmup, prompt_lookup_k=args.prompt_lookup_k, seed=args.seed,
        background_load=args.background_load)
    result = run(options, progress=not args.json)
    command = "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths = report.write(result, args.out, command=command, plot=not args.no_plots)
    if args.json:
        print(json.dumps(result))
    else:
        report.print_table(result)
        print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def cmd_advise(args, spec: LoadSpec) -> int:
    """Run `specdecode advise` on the load options of `spec` (cli.load_spec)."""
    from specdecode.bench.advise import AdviseOptions, advise, print_advice
    from specdecode.bench.runner import BenchOptions

    names = args.workloads or ["humaneval"]
    _check_workloads(names, args.limit)
    if not args.json:
        from specdecode.cli import print_memory_plan

        print_memory_plan(spec)  # before loading
    load = BenchOptions.load_fields(spec)
    del load["draft_confidence"]  # advise drafts without confidence stops
    options = AdviseOptions(
        **load, workloads=names, limit=args.limit or 2, max_tokens=args.max_tokens,
        temperature=args.temperature, max_draft_k=args.max_draft_k,
        max_ngram_k=args.max_ngram_k, seed=args.seed)
    result = advise(options)
    if args.json:
        print(json.dumps(result))
    else:
        print_advice(result)
    return 0
