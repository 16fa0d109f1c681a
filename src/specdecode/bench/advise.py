"""`specdecode advise`: should this pair speculate on this workload, with which drafter and k?

1. Measure the target's cost curve c(b) (one forward over b tokens, see
   costs.py) at the sample's context length: c_verify(k) = c(k + 1) / c(1).
2. Run each drafter on a sample of the workload at its longest k (draft-model
   without confidence stops), recording per step how many tokens were
   drafted and accepted, and the draft time per token (c_draft).
3. Predict the decoding speedup (prefill excluded) at every k by replaying
   those steps at the shorter length (metrics.replay_speedup) and recommend
   the best drafter and k, or plain decoding when nothing beats it, saying by
   how much.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.bench import metrics, workloads
from specdecode.bench.runner import BenchOptions, load_models
from specdecode.costs import default_sizes, forward_cost_curve
from specdecode.sampling import SamplingParams
from specdecode.stats import SpecStats


@dataclass
class AdviseOptions:
    target: str = "default"
    draft_model: str | None = None
    workloads: list[str] = field(default_factory=lambda: ["humaneval"])
    limit: int = 2
    max_tokens: int = 64
    temperature: float = 0.0
    max_draft_k: int = 12
    max_ngram_k: int = 24
    dtype: str = "bfloat16"
    device: str = "cpu"
    backend: str | None = None  # None: $SPECDECODE_BACKEND or auto, as LLM.load
    draft_quant: str = "auto"
    max_seq_len: int | None = None
    ngram_max: int | None = None
    ngram_min: int = 1
    seed: int = 0
    head: str | None = None  # a trained head's folder: measured as a candidate too


def _bench_options(o: AdviseOptions) -> BenchOptions:
    """The bench configurations advise measures: each drafter at its longest k, the
    draft model without confidence stops, on the same load options."""
    return BenchOptions(target=o.target, draft_model=o.draft_model, workloads=o.workloads,
                        limit=o.limit, max_tokens=o.max_tokens,
                        drafters=["draft-model", "ngram"] + _head_row(o.head),
                        draft_k=[o.max_draft_k], ngram_k=[o.max_ngram_k],
                        temperatures=[o.temperature], dtype=o.dtype, device=o.device,
                        backend=o.backend, peers=[], draft_quant=o.draft_quant,
                        draft_confidence=0.0, max_seq_len=o.max_seq_len,
                        ngram_max=o.ngram_max, ngram_min=o.ngram_min, seed=o.seed,
                        head=o.head)


def _head_row(head: str | None) -> list[str]:
    """The drafter of a trained head's row (none without a head): priced by its
    measured seconds per draft token, as any drafter without a model of its own."""
    from specdecode.drafters import head_files
    return [] if head is None else [head_files.kind(head)]


def advise(options: AdviseOptions, models=None) -> dict:
    """Measure and recommend; returns the JSON-ready advice (see `print_advice`)."""
    bench_options = _bench_options(options)
    models = models or load_models(bench_options)  # refuses a memory plan that cannot fit
    plain = models.plain
    tok = plain.tokenizer
    spec_labels = [label for label in models.llms if label != "specdecode plain"]
    prompts = {w: workloads.load(w, options.limit) for w in options.workloads}
    first = next(iter(prompts.values()))[0].ids(tok)
    max_k = max(models.llms[label].k for label in spec_labels) if spec_labels else 1
    curve = forward_cost_curve(plain.target, first, default_sizes(max_k))
    c_verify = {b: t / curve[1] for b, t in curve.items()}
    # A draft model's c_draft is its own one-token forward (its prompt prefill, inside a
    # sample's draft time, is not a per-token cost). Measured once, before any drafting,
    # so no drafter has yet recorded what its model's cache holds.
    model_c_draft = {label: forward_cost_curve(models.llms[label].drafter.model, first,
                                               [1])[1] / curve[1]
                     for label in spec_labels
                     if getattr(models.llms[label].drafter, "model", None) is not None}

    params = SamplingParams(temperature=options.temperature, max_tokens=options.max_tokens)
    per_workload = []
    for workload, ps in prompts.items():
        candidates = []
        for label in spec_labels:
            llm = models.llms[label]
            stats = SpecStats()
            for i, p in enumerate(ps):
                stats = stats.merge(llm.generate(p.ids(tok), params,
                                                 seed=options.seed + i).stats)
            method = label.split()[1]
            c_draft = model_c_draft.get(label, stats.draft_time / stats.drafted / curve[1]
                                        if stats.drafted else 0.0)
            predicted = {k: metrics.replay_speedup(stats.drafted_per_step,
                                                   stats.accepted_per_step, k, c_draft,
                                                   c_verify)
                         for k in range(1, llm.k + 1)}
            best_k = max(predicted, key=predicted.get)
            verify = c_verify.get(best_k + 1, max(c_verify.values()))
            candidates.append({"drafter": method, "measured_k": llm.k,
                               "acceptance_rate": stats.acceptance_rate,
                               "mean_accepted_length": stats.mean_accepted_length,
                               "position_acceptance": stats.position_acceptance,
                               "c_draft": c_draft, "predicted_speedup": predicted,
                               "best_k": best_k, "best_speedup": predicted[best_k],
                               "break_even_acceptance": metrics.break_even_acceptance(
                                   best_k, c_draft, verify)})
        best = max(candidates, key=lambda c: c["best_speedup"], default=None)
        per_workload.append({"workload": workload, "prompts": len(ps), "candidates": candidates,
                             "recommendation": _recommend(best)})
    return {"target": bench_options.target, "draft_model": bench_options.draft_model,
            "temperature": options.temperature, "plain_step_seconds": curve[1],
            "cost_curve_seconds": curve, "c_verify": c_verify,
            "memory": models.memory, "memory_plan": models.memory_plan,
            "workloads": per_workload}


def _recommend(best: dict | None) -> dict:
    if best is None or best["best_speedup"] < 1.0:
        loss = 1.0 - best["best_speedup"] if best else None
        why = ("no drafter was available" if best is None else
               f"the best option ({best['drafter']}, k={best['best_k']}) is predicted at "
               f"{best['best_speedup']:.2f}x, {loss:.0%} slower than plain decoding")
        return {"drafter": "none", "k": 0, "predicted_speedup": 1.0,
                "text": f"Speculation does not pay here: {why}. Use plain decoding "
                        "(--drafter none)."}
    return {"drafter": best["drafter"], "k": best["best_k"],
            "predicted_speedup": best["best_speedup"],
            "text": f"Use --drafter {best['drafter']} -k {best['best_k']}: predicted "
                    f"{best['best_speedup']:.2f}x the decoding speed of plain decoding "
                    "(prefill excluded; acceptance "
                    f"{best['acceptance_rate']:.2f}, tau {best['mean_accepted_length']:.2f} "
                    f"at k={best['measured_k']})."}


def guard_line(c: dict) -> str:
    """What the collapse guard (collapse.py) would do with this candidate: its
    acceptance against the acceptance that breaks even at its best k."""
    even, a = c["break_even_acceptance"], c["acceptance_rate"]
    if even is None:
        return (f"guard: {c['drafter']} cannot break even at any acceptance; the adaptive "
                "engine keeps speculation off (plain steps, probes now and then)")
    state = ("below: the adaptive engine switches speculation off (plain steps, probes now "
             "and then)" if a < even else "above: speculation stays on")
    return (f"guard: {c['drafter']} breaks even at acceptance {even:.2f} (k={c['best_k']}); "
            f"measured {a:.2f}, {state}")


def print_advice(advice: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=120)
    curve = advice["c_verify"]
    console.print(f"target {advice['target']}, draft model {advice['draft_model']}, "
                  f"T={advice['temperature']:g}; one plain step = "
                  f"{advice['plain_step_seconds'] * 1000:.0f} ms")
    console.print("verification cost c_verify(b) in plain steps: " + ", ".join(
        f"b={b}: {c:.2f}" for b, c in sorted(curve.items())))
    for w in advice["workloads"]:
        table = Table(title=f"workload {w['workload']} ({w['prompts']} prompts)",
                      header_style="bold")
        for name in ("drafter", "acceptance", "tau", "c_draft", "best k", "predicted",
                     "predicted speedup by k (decoding, prefill excluded)"):
            table.add_column(name, justify="left" if name == "drafter" else "right")
        for c in w["candidates"]:
            shown = [k for k in sorted(c["predicted_speedup"]) if k in (1, 2, 3, 4, 6, 8, 12,
                                                                        16, 24)]
            table.add_row(c["drafter"], f"{c['acceptance_rate']:.2f}",
                          f"{c['mean_accepted_length']:.2f}", f"{c['c_draft']:.3f}",
                          str(c["best_k"]), f"{c['best_speedup']:.2f}x",
                          " ".join(f"{k}:{c['predicted_speedup'][k]:.2f}" for k in shown))
        console.print(table)
        console.print(w["recommendation"]["text"])
        for c in w["candidates"]:
            console.print(guard_line(c))
    if advice.get("memory_plan"):
        plan = advice["memory_plan"]
        console.print("memory plan (GiB, before loading): " + ", ".join(
            f"{k} {v / 2**30:.2f}" for k, v in plan["parts"].items())
            + f"; total {plan['total'] / 2**30:.2f} of "
            + ("?" if plan["available"] is None else f"{plan['available'] / 2**30:.2f}")
            + " available")
    mem = advice["memory"]
    console.print("memory (weights + KV cache): " + ", ".join(
        f"{k} {v / 2**30:.2f} GiB" for k, v in mem.items()) + f"; total "
        f"{sum(mem.values()) / 2**30:.2f} GiB")
