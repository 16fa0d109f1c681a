"""Drafters: cheap proposers of the next k tokens, behind one protocol."""

from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter, VocabularyMismatch
from specdecode.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "DraftModelDrafter", "NgramDrafter", "VocabularyMismatch"]
