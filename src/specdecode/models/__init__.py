"""Models: the CausalLM protocol and its implementations."""

from specdecode.models.base import CausalLM, ForwardOutput
from specdecode.models.config import PRESETS, ModelConfig
from specdecode.models.transformer import Transformer

__all__ = ["CausalLM", "ForwardOutput", "ModelConfig", "PRESETS", "Transformer"]
