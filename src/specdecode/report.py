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


def divergence(llm, prompt_ids: list[int], params, result, plain) -> dict | None:
    """Where a greedy `result` parts from plain decoding's: the token index, the
    target's top-2 logit margin there (a fresh prefill, bench/summary.py) and the
    verdict by the backend's near-tie threshold (check/near_tie.py). None where the
    outputs are equal or the run sampled (sampled tokens are not promised equal)."""
    from specdecode.check.near_tie import judge, threshold

    if plain is None or plain.token_ids == result.token_ids or not params.greedy:
        return None
    limit = threshold(llm.info.backend, str(llm.target.dtype).removeprefix("torch."))
    verdict, found = judge(llm.target, prompt_ids, plain.token_ids, result.token_ids, limit)
    return {**found, "threshold": limit, "verdict": verdict}


def _same_line(d: dict, backend: str) -> str:
    """The report's last line: speed-up and whether the outputs are plain decoding's."""
    speedup = "n/a" if d["speedup"] is None else f"{d['speedup']:.2f}x"
    line = f"speedup vs plain: {speedup}; outputs "
    if d["identical_to_plain"]:
        return line + "identical to plain decoding"
    found = d.get("divergence")
    if found is None:
        return line + "DIFFERENT to plain decoding"
    where = (f"differ from plain decoding from token {found['index']} on, where the "
             f"target's top-2 logit margin is {found['top2_margin']:.3f}")
    if found["verdict"].startswith("near-tie"):
        return (line + where + f": a near-tie (below {found['threshold']}), which "
                f"{backend}'s batched passes round differently from one-token steps "
                "(README \"Exactness\"; `specdecode check` tests this pair)")
    return (line + where + f": NOT a near-tie (threshold {found['threshold']}); please "
            "report it with `specdecode check`'s output")


def result_dict(llm, result, plain=None, divergence: dict | None = None) -> dict:
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
        out["divergence"] = divergence
        spec_tps, plain_tps = out["tokens_per_second"], out["plain"]["tokens_per_second"]
        out["speedup"] = spec_tps / plain_tps if plain_tps else None
    return out


def print_report(llm, result, plain=None, file=None, divergence: dict | None = None) -> None:
    console = Console(file=file or sys.stderr)
    d = result_dict(llm, result, plain, divergence)
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
        console.print(_same_line(d, llm.info.backend))
