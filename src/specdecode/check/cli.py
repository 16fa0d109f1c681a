"""`specdecode check`: its flags, the run of the checks asked for, the table it prints.

Exit status: 0 when every case passed, 1 when one failed, 2 for bad options (checked
before any model is loaded, one line on stderr, as every command: cli.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdecode.argtypes import choice_list, int_list, positive_int, seed
from specdecode.bench import workloads
from specdecode.check import CHECKS, Row

DEFAULT_WORKLOADS = ("humaneval", "chat")


def add_parser(sub, add_load_args) -> None:
    """Register `check` on the CLI's subparsers (cli.py's one set of load options)."""
    p = sub.add_parser("check", help="conformance run on this pair, backend and machine: "
                                     "greedy identity, the verifier's law, stops, fallback")
    add_load_args(p, without=("k", "adaptive"))
    p.add_argument("--adaptive", action="store_true", default=None,
                   help="the fallback check runs the closed-loop engine")
    p.add_argument("--checks", type=choice_list(CHECKS), default=list(CHECKS),
                   help=f"comma-separated (default: {','.join(CHECKS)})")
    p.add_argument("--workload", "-w", action="append", default=None, dest="workloads",
                   help=f"{', '.join(workloads.NAMES)} or a .jsonl file (repeatable; "
                        "default: humaneval and chat)")
    p.add_argument("--prompts", type=positive_int, default=2, help="prompts per workload")
    p.add_argument("--ks", type=int_list, default=[1, 4], help="k values (default 1,4)")
    p.add_argument("--max-tokens", "-n", type=positive_int, default=64)
    p.add_argument("--draws", type=positive_int, default=4000,
                   help="verifier runs per distribution case (default 4000)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", default=None, metavar="PATH|-",
                   help="write the rows as JSON to PATH (-: stdout, instead of the table)")


def run_checks(pair, args) -> list[Row]:
    """The checks of `args.checks` on `pair` (pair.Pair), in CHECKS order."""
    from specdecode.check.distribution import check_distribution
    from specdecode.check.fallback import check_fallback
    from specdecode.check.greedy import check_greedy
    from specdecode.check.stops import check_stops

    prompts = pair.prompts(args.workloads or DEFAULT_WORKLOADS, args.prompts)
    runs = {"greedy": lambda: check_greedy(pair, prompts, args.ks, args.max_tokens),
            "distribution": lambda: check_distribution(pair, prompts, args.draws, args.seed),
            "stops": lambda: check_stops(pair, prompts, args.ks, args.max_tokens),
            "fallback": lambda: check_fallback(pair, prompts, args.max_tokens)}
    rows: list[Row] = []
    for name in CHECKS:
        if name in args.checks:
            rows += runs[name]()
            if args.json != "-":
                print(f"check {name}: done", file=sys.stderr)
    return rows


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("check", "case", "result", "detail"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(r.check, r.case, "PASS" if r.passed else "[bold red]FAIL[/]", r.detail)
    Console(width=200).print(table)


def cmd_check(args, spec) -> int:
    """Run `specdecode check` on the load options of `spec` (cli.load_spec)."""
    from specdecode.check.pair import Pair

    for name in args.workloads or DEFAULT_WORKLOADS:
        workloads.load(name, args.prompts)  # a bad workload fails before loading
    pair = Pair.load(spec)
    rows = run_checks(pair, args)
    failed = sum(not r.passed for r in rows)
    info = pair.loaded.info
    draft = f" + {Path(info.draft).name}" if info.draft else ""
    weights = spec.dtype if pair.backend == "torch" else "GGUF weights"
    title = (f"specdecode check: {Path(info.target).name}{draft} on {pair.backend} ({weights}), "
             f"near-tie threshold {pair.limit}: {len(rows) - failed}/{len(rows)} passed")
    if args.json is not None:
        text = json.dumps({"title": title, "rows": [r.to_dict() for r in rows]})
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print_table(rows, title)
    return 1 if failed else 0
