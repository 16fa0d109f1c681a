"""specdecode: lossless speculative decoding of language models.

A cheap drafter proposes k tokens, the target scores them in one pass, and the
verifier keeps exactly what the target would have produced (greedy) or
applies exact rejection sampling (sampling). Public API:

    from specdecode import SpeculativeDecoder, SamplingParams
    from specdecode.models import Transformer, PRESETS
    from specdecode.drafters import DraftModelDrafter, NgramDrafter
"""

from specdecode.drafters import (
    BaseDrafter,
    Draft,
    DraftContext,
    Drafter,
    DraftModelDrafter,
    NgramDrafter,
)
from specdecode.engine import GenerationResult, Request, SpeculativeDecoder, StepEvent
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.stats import SpecStats

__version__ = "0.1.0"

__all__ = [
    "BaseDrafter", "Draft", "DraftContext", "Drafter", "DraftModelDrafter", "GenerationResult",
    "NgramDrafter", "Request", "SamplingParams", "SpecStats", "SpeculativeDecoder", "StepEvent",
    "logits_to_probs",
]
