"""Bench results as a terminal table, a Markdown report and a JSON file.

JSON schema ("schema": "specdecode.bench/1"):
- date, machine {cpu, cores, threads, torch, python, dtype, device, backend},
  options (the BenchOptions used), configs (labels in run order),
  memory {target, draft, head, hf_target, hf_draft, peak_rss, predicted_peak_rss} in
  bytes (peak_rss: VmHWM of this process; predicted: memory.py's plan, whose
  parts are in memory_plan, a trained head's weights and KV cache included;
  torch models: weights + buffers + the static KV cache; head: a trained head's
  own tensors, the target's embedding it reads left out), notes (peers skipped and why);
- summary: one object per (workload, temperature, config), fields in
  specdecode.bench.summary's docstring;
- runs: one object per timed run: workload, prompt, temperature, repeat,
  config, engine, method, k, prompt_tokens, new_tokens, token_ids,
  finish_reason, seconds (wall, prefill included), tokens_per_second;
  specdecode runs add prefill_seconds and stats (SpecStats.to_dict plus
  position_tried / position_accepted); at T=0 non-plain runs add divergence
  (null, or {index, reference_token, other_token, top2_margin}).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _f(value, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _exact(entry: dict) -> str:
    if "exact_match" not in entry:
        return "-"
    same, n = entry["exact_match"]
    return f"{same}/{n}"


COLUMNS = [
    ("workload", lambda e: e["workload"]),
    ("T", lambda e: f"{e['temperature']:g}"),
    ("configuration", lambda e: e["config"]),
    ("tok/s (median)", lambda e: _f(e["tokens_per_second"])),
    ("min-max", lambda e: f"{e['tokens_per_second_min']:.2f}-{e['tokens_per_second_max']:.2f}"),
    ("speedup", lambda e: _f(e["speedup"], suffix="x")),
    ("vs specdecode plain", lambda e: _f(e["vs_specdecode_plain"], suffix="x")),
    ("vs HF plain", lambda e: _f(e["vs_hf_plain"], suffix="x")),
    ("acceptance", lambda e: _f(e.get("acceptance_rate"))),
    ("tau", lambda e: _f(e.get("mean_accepted_length"))),
    ("identical", _exact),
    ("spec off (guard)", lambda e: _f(e.get("guard_plain_fraction"), ".0%")),
]

COST_COLUMNS = [
    ("workload", lambda e: e["workload"]),
    ("T", lambda e: f"{e['temperature']:g}"),
    ("configuration", lambda e: e["config"]),
    ("k_eff", lambda e: _f(e.get("k_eff"))),
    ("c_draft", lambda e: _f(e.get("c_draft"), ".3f")),
    ("c_verify", lambda e: _f(e.get("c_verify"))),
    ("decode speedup", lambda e: _f(e.get("decode_speedup"), suffix="x")),
    ("theoretical", lambda e: _f(e.get("theoretical_speedup"), suffix="x")),
    ("measured/theory", lambda e: _f(e.get("measured_over_theoretical"))),
    ("time prefill/draft/verify/other (s)", lambda e: "/".join(
        f"{e['time_split'][k]:.1f}" for k in ("prefill", "draft", "verify", "other"))),
]


TURN_COLUMNS = [
    ("workload", lambda e: e["workload"]),
    ("T", lambda e: f"{e['temperature']:g}"),
    ("configuration", lambda e: e["config"]),
    ("turn", lambda e: str(e["turn"])),
    ("prompt tokens", lambda e: _f(e["prompt_tokens"], ".0f")),
    ("reused", lambda e: _f(e["cached_tokens"], ".0f")),
    ("time to first token (s)", lambda e: _f(e["ttft_seconds"])),
    ("decode tok/s", lambda e: _f(e["decode_tokens_per_second"])),
    ("tok/s", lambda e: _f(e["tokens_per_second"])),
]


TERMINAL = ("workload", "T", "configuration", "tok/s (median)", "speedup", "vs HF plain",
            "acceptance", "tau", "identical", "spec off (guard)")


def print_table(result: dict, console: Console | None = None) -> None:
    console = console or Console(stderr=True, width=132)
    columns = [(name, get) for name, get in COLUMNS if name in TERMINAL]
    table = Table(title="specdecode bench", header_style="bold")
    for name, _ in columns:
        table.add_column(name, justify="left" if name in ("workload", "configuration")
                         else "right")
    for e in result["summary"]:
        table.add_row(*(get(e) for _, get in columns))
    console.print(table)
    console.print(memory_line(result))
    for note in result["notes"]:
        console.print(f"note: {note}")


def memory_line(result: dict) -> str:
    """Measured peak RSS against the memory plan's prediction (memory.py)."""
    mem, plan = result["memory"], result.get("memory_plan")
    line = f"peak RSS {mem['peak_rss'] / 2**30:.2f} GiB measured"
    if not plan:
        return line
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan["parts"].items())
    ratio = plan["predicted_peak_rss"] / mem["peak_rss"] if mem["peak_rss"] else 0.0
    return (f"{line}; predicted {plan['predicted_peak_rss'] / 2**30:.2f} GiB "
            f"({ratio:.2f}x the measured; plan in GiB: {parts})")


def _md_table(columns, entries) -> list[str]:
    lines = ["| " + " | ".join(name for name, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(get(e) for _, get in columns) + " |" for e in entries]
    return lines


def markdown(result: dict, command: str | None = None, plots: list[str] = ()) -> str:
    m, o = result["machine"], result["options"]
    lines = ["# specdecode bench", "",
             f"{result['date']}. Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} "
             f"threads, torch {m['torch']}, {m['dtype']} on {m['device']} ({m['backend']} "
             "backend).",
             f"Target `{o['target']}`, draft model `{o['draft_model']}`; workloads "
             f"{', '.join(o['workloads'])}; {o['max_tokens']} new tokens; {o['repeats']} "
             "repeat(s) after a warm-up; every configuration run in turn on each prompt "
             "(interleaved). tokens/s = new tokens / wall seconds, prefill included.", ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    lines += ["## Speed, acceptance, exactness", ""] + _md_table(COLUMNS, result["summary"])
    lines += ["", "speedup: against the same engine's plain decoding, paired per prompt; "
              "identical: greedy outputs equal to that plain decoding's.", "",
              "## Costs and the theoretical limit", "",
              "c_draft (per draft token) and c_verify (per verification pass) in units of one "
              "plain target step; theoretical = (1 - a^(k+1)) / (1 - a) / (k c_draft + "
              "c_verify) at the measured acceptance a and mean draft length k = k_eff; "
              "decode speedup excludes prefill.", ""]
    spec = [e for e in result["summary"] if e["engine"] == "specdecode" and e["method"] != "plain"]
    lines += _md_table(COST_COLUMNS, spec)
    lines += ["", "## Acceptance by draft position", ""]
    for e in spec:
        pos = ", ".join(f"{a:.2f}" for a in (e.get("position_acceptance") or [])[:16])
        lines.append(f"- {e['workload']} T={e['temperature']:g} {e['config']}: {pos}")
    divergences = [(e, d) for e in result["summary"] for d in e.get("divergences", [])]
    if divergences:
        lines += ["", "## Greedy divergences from plain decoding", "",
                  "| workload | configuration | prompt | token index | top-2 logit margin |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['workload']} | {e['config']} | {d['prompt']} | "
                  f"{_f(d['index'], 'd')} | {_f(d.get('top2_margin'), '.3f')} |"
                  for e, d in divergences]
    if result.get("turns"):
        lines += ["", "## Per turn (multi-turn workloads)", "",
                  "Medians over trajectories. Each configuration decodes its own trajectory "
                  "(its own answers), only turn 1 starting from an empty cache; time to first "
                  "token includes the prefill of the prompt tokens not reused.", ""]
        lines += _md_table(TURN_COLUMNS, result["turns"])
    mem = result["memory"]
    lines += ["", "## Memory", ""] + [f"- {k}: {v / 2**30:.2f} GiB" for k, v in mem.items()]
    lines += ["", memory_line(result)]
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def write(result: dict, out: str | Path, command: str | None = None,
          plot: bool = True) -> dict[str, Path]:
    """Write OUT.json, OUT.md and (plot=True) OUT-*.png; returns the paths by kind."""
    from specdecode.bench import plots

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": out.with_suffix(".json"), "markdown": out.with_suffix(".md")}
    paths["json"].write_text(json.dumps(result, indent=1))
    pngs = plots.write_all(result, out) if plot else []
    paths["markdown"].write_text(markdown(result, command, [str(p) for p in pngs]))
    paths.update({p.stem: p for p in pngs})
    return paths
