"""Stops inside drafts: the same text, ids, usage and finish_reason as plain decoding.

Cases, on the first prompt's plain greedy output: an end token inside a draft (one
of the output's own tokens made a stop token id: the engine checks EOS and stop
token ids as one set, engine.Request.stops), max_tokens mid-draft (k + 3: inside
the second draft), and a stop string spanning two tokens (the last character of
one output token and the first of the next).
"""

from __future__ import annotations

from dataclasses import replace

from specdecode.check import Row
from specdecode.check.pair import Pair, cold_generate
from specdecode.sampling import SamplingParams


def _spanning_stop(tokenizer, ids: list[int]) -> str | None:
    """A string across a token boundary that first occurs there, from the middle on."""
    text = tokenizer.decode(ids)
    for i in range(len(ids) // 2, len(ids) - 1):
        head, tail = tokenizer.decode(ids[: i + 1]), tokenizer.decode(ids[: i + 2])
        if not text.startswith(tail) or len(tail) == len(head) or not head:
            continue
        s = head[-1] + tail[len(head)]
        if s.strip() and text.find(s) == len(head) - 1:
            return s
    return None


def cases(pair: Pair, ids: list[int], k: int, max_tokens: int) -> dict[str, SamplingParams]:
    base = SamplingParams(max_tokens=max_tokens)
    ref = pair.plain_answer(ids, max_tokens)
    out = {"max_tokens mid-draft": replace(base, max_tokens=min(k + 3, max_tokens))}
    at = next((i for i in range(len(ref) // 3, len(ref)) if ref.index(ref[i]) == i), None)
    if at is not None:
        out[f"end token inside a draft (token {at})"] = replace(
            base, stop_token_ids=(ref[at],))
    stop = _spanning_stop(pair.plain.tokenizer, ref)
    if stop is not None:
        out[f"stop string {stop!r} spanning tokens"] = replace(base, stop=(stop,))
    return out


def check_stops(pair: Pair, prompts: list[tuple[str, list[int]]], ks: list[int],
                max_tokens: int) -> list[Row]:
    """One row per (case, drafter) at the largest k."""
    name, ids = prompts[0]
    k, rows = max(ks), []
    for case, params in cases(pair, ids, k, max_tokens).items():
        plain = cold_generate(pair.plain, ids, params, speculative=False)
        for drafter in pair.drafters:
            spec = cold_generate(pair.llm(drafter, k), ids, params)
            rows.append(_row(pair, ids, plain, spec, f"{case}, {drafter} k={k}"))
    return rows


def _fields(r) -> dict:
    return {"text": r.text, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens}


def _row(pair: Pair, ids: list[int], plain, spec, case: str) -> Row:
    want, got = _fields(plain), _fields(spec)
    differ = [key for key in want if want[key] != got[key]]
    verdict, where = pair.compare(ids, plain.token_ids, spec.token_ids)
    if where is not None:
        differ.insert(0, "ids")
    ok = not differ or verdict == "near-tie (backend rounding)"
    detail = (f"finish {got['finish_reason']}, {got['completion_tokens']} tokens, "
              f"drafted {spec.stats.drafted} accepted {spec.stats.accepted}")
    if differ:
        detail += f"; differs in {', '.join(differ)}"
        if where is not None:
            detail += f" at token {where['index']} (margin {where['top2_margin']:.3f}: {verdict})"
    else:
        detail += "; text, ids, usage, finish_reason as plain"
    return Row("stops", case, ok, detail, {"plain": want, "speculative": got,
                                          "differ": differ, "divergence": where})
