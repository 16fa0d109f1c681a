"""Native PyTorch decoder for the Llama / Qwen2 family with a static KV cache.

RMSNorm, rotary position embeddings (configurable base, rotate-half layout as
in HF transformers), grouped-query attention, SwiGLU MLP, optional qkv bias,
tied or untied embeddings. Parameter names follow HF transformers
(`layers.0.self_attn.q_proj.weight`, ...) without the `model.` prefix, so a
safetensors checkpoint maps onto it by name.

The KV cache is preallocated for `max_seq_len` tokens and written by position,
so `rollback(n)` only moves the length pointer (gpt-fast style). Works on any
device and in float32 / bfloat16 / float16; logits come back in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdecode import limits
from specdecode.models.base import ForwardOutput
from specdecode.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., head_dim]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor,  # [1, heads, T, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [1, T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        mask: torch.Tensor | None,  # [T, start + T] bool, True = may attend
        k_cache: torch.Tensor,  # [kv_heads, max_seq_len, head_dim]
        v_cache: torch.Tensor,  # [kv_heads, max_seq_len, head_dim]
        start: int,
    ) -> torch.Tensor:  # [1, T, hidden]
        t = x.shape[1]
        q = self.q_proj(x).view(1, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + t
        k_cache[:, start:end] = k[0]
        v_cache[:, start:end] = v[0]
        keys, values = k_cache[None, :, :end], v_cache[None, :, :end]
        group = self.num_heads // self.num_kv_heads
        if mask is None and start == 0 and t > 1:
            # A fresh prefill is plain causal attention, which lets SDPA skip the
            # masked half instead of reading a [T, T] mask.
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                                 enable_gqa=group > 1)
        else:
            # Decoding / verification: fold the query heads that share a KV head into
            # one block of rows, so that SDPA reads each cached head once (with
            # enable_gqa it copies them `group` times: 4x slower at 2k tokens on CPU).
            rows = q.reshape(1, self.num_kv_heads, group * t, self.head_dim)
            out = F.scaled_dot_product_attention(
                rows, keys, values, attn_mask=None if mask is None else mask.repeat(group, 1),
            ).view(1, self.num_heads, t, self.head_dim)  # [1, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(1, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [1, T, hidden]
        # In place: no fresh [T, intermediate] buffers per layer (32 MB each for a
        # 1.8k-token prompt, page-faulted anew every time): that prefill 5.6 -> 4.7 s.
        gate = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(gate.mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, k_cache, v_cache, start):  # x: [1, T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


def prefill_bucket(t: int, limit: int) -> int:
    """The length a fresh t-token prompt runs at: t rounded up to a multiple of 16
    up to 256 tokens, then to one of 8 sizes per octave (at most 12.5 % padding),
    never beyond `limit`. Every new matrix shape costs CPU kernels a cached
    primitive (oneDNN keeps up to 1024, each with JIT code and scratch memory):
    a server seeing every prompt length once grew ~8.4 MB per new length
    (1.07 -> 2.17 GB over ~800 requests). With buckets a context of 8192 tokens
    has at most 56 prompt shapes."""
    step = 1 << max(4, (t - 1).bit_length() - 4)
    return max(t, min(limit, -(-t // step) * step))


class Transformer(nn.Module):
    """A `CausalLM`: decoder weights plus one sequence's static KV cache."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = limits.check_context(max_seq_len or cfg.max_position_embeddings,
                                                cfg.max_position_embeddings)
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        with torch.device(device):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        self.to(dtype)
        self._len = 0
        self._allocate_cache()

    # -- construction ---------------------------------------------------------

    @classmethod
    def random(
        cls,
        cfg: ModelConfig,
        seed: int,
        *,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        logit_scale: float = 3.0,
    ) -> Transformer:
        """A model with seeded random weights (same seed, same model, any machine).

        Linear weights keep activations at unit scale; `logit_scale` sets the
        standard deviation of the logits, so argmax ties are rare in tests.
        """
        model = cls(cfg, max_seq_len=max_seq_len, dtype=torch.float32, device="cpu")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
                elif name.endswith("bias"):
                    param.copy_(0.1 * torch.randn(param.shape, generator=gen))
                elif name == "embed_tokens.weight":
                    param.copy_(torch.randn(param.shape, generator=gen))
                else:
                    std = 1.0 / math.sqrt(param.shape[1])
                    param.copy_(std * torch.randn(param.shape, generator=gen))
            if not cfg.tie_word_embeddings:
                model.lm_head.weight.mul_(logit_scale)
        if cfg.tie_word_embeddings:
            # Tied: scale through the final norm so embeddings stay unit scale.
            with torch.no_grad():
                model.norm.weight.mul_(logit_scale / math.sqrt(cfg.hidden_size))
        return model.to(device=device, dtype=dtype)

    def _allocate_cache(self) -> None:
        """KV cache and RoPE tables for max_seq_len tokens, on the weights' device and
        dtype; a ValueError first if they would not fit in the memory left."""
        cfg, ref = self.config, self.embed_tokens.weight
        elem = ref.element_size()
        limits.check_memory(
            limits.kv_cache_bytes(cfg, self.max_seq_len, elem)
            + limits.rope_bytes(cfg, self.max_seq_len, elem),
            f"the KV cache of {self.max_seq_len} tokens", str(ref.device))
        shape = (cfg.num_kv_heads, self.max_seq_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=ref.dtype, device=ref.device)
                        for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=ref.dtype, device=ref.device)
                        for _ in range(cfg.num_layers)]
        inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=ref.device)
            / cfg.head_dim))
        angles = torch.outer(
            torch.arange(self.max_seq_len, dtype=torch.float64, device=ref.device), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [max_seq_len, head_dim]
        self.rope_cos = angles.cos().to(ref.dtype)
        self.rope_sin = angles.sin().to(ref.dtype)

    def _apply(self, fn, recurse=True):  # keep cache and RoPE tables with the weights
        super()._apply(fn, recurse)
        if hasattr(self, "k_cache"):
            self._allocate_cache()
            self._len = 0
        return self

    # -- CausalLM -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def cached_len(self) -> int:
        return self._len

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._len} tokens")
        self._len = length

    def prefill(self, ids: torch.Tensor) -> ForwardOutput:  # ids: [T] int64
        self._len = 0
        return self.forward(ids, last_n=1)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,  # [T] int64
        *,
        last_n: int | None = None,
        return_hidden: bool = False,
        positions: torch.Tensor | None = None,  # [T] int64
        tree_mask: torch.Tensor | None = None,  # [T, T] bool
    ) -> ForwardOutput:
        t, start = ids.shape[0], self._len
        if start + t > self.max_seq_len:
            raise ValueError(
                f"{start + t} tokens exceed the context limit of {self.max_seq_len}")
        ids = ids.to(self.device)
        if start == 0 and t > 1 and positions is None and tree_mask is None:
            # A fresh prompt runs at a bucketed length (see prefill_bucket): the padding
            # comes after it, so causal attention keeps it out of the prompt's rows.
            ids = torch.cat((ids, ids.new_zeros(prefill_bucket(t, self.max_seq_len) - t)))
        t_run = ids.shape[0]
        if positions is None:
            cos, sin = self.rope_cos[start:start + t_run], self.rope_sin[start:start + t_run]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = None
        if tree_mask is not None or (t > 1 and start > 0):
            block = tree_mask if tree_mask is not None else torch.ones(
                t, t, dtype=torch.bool, device=self.device).tril_()
            mask = torch.cat((torch.ones(t, start, dtype=torch.bool, device=self.device),
                              block.to(self.device)), dim=1)  # [T, start + T]
        x = self.embed_tokens(ids)[None]  # [1, T, hidden]
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache):
            x = layer(x, cos, sin, mask, k_cache, v_cache, start)
        self._len = start + t  # the padding's keys/values are overwritten as tokens come
        x = x[0, :t] if last_n is None else x[0, t - last_n:t]
        hidden = self.norm(x)  # [n, hidden]
        logits = self.lm_head(hidden).float()  # [n, vocab]
        return ForwardOutput(logits, hidden if return_hidden else None)
