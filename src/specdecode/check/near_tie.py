"""Which greedy divergences are rounding and which are bugs, by a stated threshold.

A speculative pass scores k + 1 tokens in one batch, plain decoding one token at a
time; where the backend rounds the two differently, greedy output can part from
plain decoding at a near-tie of the target's top-2 logits (README "Exactness").
A divergence whose top-2 margin is below the backend's threshold is "near-tie
(backend rounding)"; anything else is "not a tie: BUG". On float32 torch the two
passes are bit-identical, so the threshold is 0: every divergence fails.
"""

from __future__ import annotations

# Top-2 logit margin (logit units) below which a divergence counts as rounding:
# bf16/fp16 torch: a few bf16 steps at logits ~20-30 (one step there is 0.125);
# llama.cpp: batched kernels differ from one-token steps by up to ~0.5 on a Xeon and up
# to 0.99 (49 tokens after 1.8k) on a Zen 5 (bench/results/flash-attn-zen5.md; README).
NEAR_TIE = {"float32": 0.0, "bfloat16": 0.5, "float16": 0.5, "llama.cpp": 1.0}


def threshold(backend: str, dtype: str) -> float:
    """The near-tie threshold of a backend (llama.cpp) or of torch at `dtype`."""
    return NEAR_TIE["llama.cpp"] if backend == "llama.cpp" else NEAR_TIE.get(dtype, 0.5)


def judge(target, prompt_ids: list[int], reference: list[int], other: list[int],
          limit: float) -> tuple[str, dict | None]:
    """(verdict, divergence): classify of where `other` parts from `reference`, with the
    target's top-2 margin there (bench/summary.py, a fresh prefill; the target's cache
    is left empty)."""
    from specdecode.bench.summary import margin_at_divergence

    divergence = margin_at_divergence(target, prompt_ids, reference, other)
    target.rollback(0)
    return classify(divergence, limit), divergence


def classify(divergence: dict | None, limit: float) -> str:
    """"identical", "near-tie (backend rounding)" or "not a tie: BUG"."""
    if divergence is None:
        return "identical"
    margin = divergence.get("top2_margin")
    if margin is not None and margin < limit:
        return "near-tie (backend rounding)"
    return "not a tie: BUG"
