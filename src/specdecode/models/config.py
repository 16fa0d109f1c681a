"""Model configuration for the Llama / Qwen2 decoder family, plus named presets.

One dataclass describes every supported architecture: Llama (SmolLM2,
Mistral-style without sliding window) and Qwen2 (qkv bias) differ only in
fields here, never in separate model files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    arch: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # Tiny shapes for tests and demos with seeded random weights.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=512, eos_token_ids=(0,),
    ),
    "tiny-qwen2": ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3,
        num_heads=4, num_kv_heads=1, rope_theta=1_000_000.0, qkv_bias=True,
        tie_word_embeddings=True, max_position_embeddings=512, eos_token_ids=(0,),
        arch="qwen2",
    ),
    # The shapes of the default pair (real weights come from models/loading.py).
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, rope_theta=1_000_000.0, qkv_bias=True,
        tie_word_embeddings=True, max_position_embeddings=32768,
        eos_token_ids=(151645, 151643), arch="qwen2",
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, rope_theta=1_000_000.0, qkv_bias=True,
        tie_word_embeddings=True, max_position_embeddings=32768,
        eos_token_ids=(151645, 151643), arch="qwen2",
    ),
}
