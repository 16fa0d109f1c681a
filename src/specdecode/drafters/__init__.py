"""Drafters: cheap proposers of the next k tokens, behind one protocol."""

from specdecode.drafters.base import BaseDrafter, Draft, DraftContext, Drafter, TargetOutput
from specdecode.drafters.draft_model import DraftModelDrafter, VocabularyMismatch
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixStore

__all__ = ["BaseDrafter", "Draft", "DraftContext", "Drafter", "DraftModelDrafter",
           "NgramDrafter", "SuffixDrafter", "SuffixStore", "TargetOutput", "VocabularyMismatch"]
