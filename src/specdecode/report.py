"""Human and JSON reports of one generation (and its plain-decoding twin)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def _run_dict(result) -> dict:
    s = result.stats
    decode_time = s.decode_time
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "seconds": result.seconds,
        "tokens_per_second": result.completion_tokens / decode_time if decode_time else 0.0,
        "stats": s.to_dict(),
    }


def _memory(llm) -> dict | None:
    """The memory plan checked before loading (memory.py) and the peak RSS so far."""
    from specdecode.memory import peak_resident_bytes

    plan = getattr(llm.info, "memory", None)
    return None if plan is None else {**plan, "peak_rss_bytes": peak_resident_bytes()}


def result_dict(llm, result, plain=None) -> dict:
    out = {
        "target": llm.info.target,
        "draft": llm.info.draft,
        "drafter": llm.info.drafter,
        "backend": llm.info.backend,
        "k": llm.k,
        "choice": llm.info.choice,
        "costs": llm.info.costs,
        "load_seconds": llm.info.seconds,
        "memory": _memory(llm),
        **_run_dict(result),
    }
    if plain is not None:
        out["plain"] = _run_dict(plain)
        out["identical_to_plain"] = plain.token_ids == result.token_ids
        spec_tps, plain_tps = out["tokens_per_second"], out["plain"]["tokens_per_second"]
        out["speedup"] = spec_tps / plain_tps if plain_tps else None
    return out


def print_report(llm, result, plain=None, file=None) -> None:
    console = Console(file=file or sys.stderr)
    d = result_dict(llm, result, plain)
    s = result.stats
    table = Table(title="specdecode", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("speculative" if llm.speculative else "plain",
                     justify="right")
    if plain is not None:
        table.add_column("plain", justify="right")

    def row(name: str, value: str, plain_value: str = "") -> None:
        table.add_row(name, value, *([plain_value] if plain is not None else []))

    p = plain.stats if plain is not None else None
    row("drafter", f"{llm.info.drafter} (k={llm.k})", "none")
    row("tokens", str(result.completion_tokens), str(plain.completion_tokens) if p else "")
    row("finish reason", result.finish_reason, plain.finish_reason if p else "")
    row("tokens/s", f"{d['tokens_per_second']:.2f}",
        f"{d['plain']['tokens_per_second']:.2f}" if p else "")
    row("steps", str(s.steps), str(p.steps) if p else "")
    row("acceptance rate", f"{s.acceptance_rate:.3f}", "")
    row("mean accepted length", f"{s.mean_accepted_length:.2f}",
        f"{p.mean_accepted_length:.2f}" if p else "")
    row("position acceptance", " ".join(f"{a:.2f}" for a in s.position_acceptance), "")
    row("time draft / verify / other (s)",
        f"{s.draft_time:.2f} / {s.verify_time:.2f} / {s.other_time:.2f}",
        f"{p.draft_time:.2f} / {p.verify_time:.2f} / {p.other_time:.2f}" if p else "")
    row("prefill (s)", f"{s.prefill_time:.2f}", f"{p.prefill_time:.2f}" if p else "")
    console.print(table)
    if llm.info.choice:
        console.print(f"{llm.info.backend}: {llm.info.choice}")
    if plain is not None:
        same = "identical" if d["identical_to_plain"] else "DIFFERENT"
        console.print(f"speedup vs plain: {d['speedup']:.2f}x; outputs {same} to plain decoding")
