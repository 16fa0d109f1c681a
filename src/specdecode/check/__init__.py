"""`specdecode check`: a conformance run on the user's pair, backend and machine.

Four checks, one module each, each returning `Row`s (one per case, passed or not):
- greedy.py: speculative vs plain greedy decoding, each drafter in use at a few k;
  divergences classified by the target's top-2 logit margin there (near_tie.py).
- distribution.py: the engine's verifier run many times on (p, q) captured from
  the pair at real positions; emitted tokens tested against p (chi-square).
- stops.py: EOS inside a draft, max_tokens mid-draft, a stop string spanning
  tokens: same text, ids, usage and finish_reason as plain decoding.
- fallback.py: drafts forced wrong still give plain output at plain speed.
`run.py` loads the models once and runs the checks asked for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    """One case of one check. passed: the case conforms; detail: one line for the
    table; data: the numbers behind it (JSON-ready)."""

    check: str
    case: str
    passed: bool
    detail: str
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


CHECKS = ("greedy", "distribution", "stops", "fallback")
