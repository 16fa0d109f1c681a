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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode import limits
from specdecode.models.base import (
    FINAL_LAYER,
    CacheSnapshot,
    ForwardOutput,
    check_keep,
    wanted_layers,
)
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


def rope_angles(positions: torch.Tensor,  # [T] int64
                head_dim: int, theta: float) -> torch.Tensor:  # [T, head_dim] float64
    """RoPE angles of each position, in the rotate-half layout (both halves equal)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                             device=positions.device) / head_dim))
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    return torch.cat((angles, angles), dim=-1)


def apply_rope(
    x: torch.Tensor,  # [1, heads, T, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@dataclass
class Span:
    """One sequence's rows in a (possibly packed) pass: where its tokens sit in the
    input, where they go in its cache, and their RoPE angles and attention mask."""

    rows: slice  # its rows of the packed [1, N, hidden] input (t_run of them)
    start: int  # its cached_len before the pass
    cos: torch.Tensor  # [t_run, head_dim]
    sin: torch.Tensor  # [t_run, head_dim]
    mask: torch.Tensor | None  # [t_run, start + t_run] bool, True = may attend; None: causal


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
        x: torch.Tensor,  # [1, N, hidden]: the rows of every span, packed
        spans: list[Span],
        caches: list[tuple[torch.Tensor, torch.Tensor]],  # per span: k, v caches (see _attend)
    ) -> torch.Tensor:  # [1, N, hidden]
        n = x.shape[1]
        q = self.q_proj(x).view(1, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        outs = [self._attend(q[:, :, s.rows], k[:, :, s.rows], v[:, :, s.rows], s, *kv)
                for s, kv in zip(spans, caches)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, heads, N, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(1, n, -1))

    def _attend(
        self,
        q: torch.Tensor,  # [1, heads, T, head_dim] one span's queries, before RoPE
        k: torch.Tensor,  # [1, kv_heads, T, head_dim]
        v: torch.Tensor,  # [1, kv_heads, T, head_dim]
        span: Span,
        k_cache: torch.Tensor,  # [kv_heads, max_seq_len, head_dim]
        v_cache: torch.Tensor,  # [kv_heads, max_seq_len, head_dim]
    ) -> torch.Tensor:  # [1, heads, T, head_dim]
        """Write the span's keys/values at start.. in its cache and attend over it."""
        t, start, mask = q.shape[2], span.start, span.mask
        q, k = apply_rope(q, span.cos, span.sin), apply_rope(k, span.cos, span.sin)
        end = start + t
        k_cache[:, start:end] = k[0]
        v_cache[:, start:end] = v[0]
        keys, values = k_cache[None, :, :end], v_cache[None, :, :end]
        group = self.num_heads // self.num_kv_heads
        if mask is None and start == 0 and t > 1:
            # A fresh prefill is plain causal attention, which lets SDPA skip the
            # masked half instead of reading a [T, T] mask.
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                                  enable_gqa=group > 1)
        # Decoding / verification: fold the query heads that share a KV head into
        # one block of rows, so that SDPA reads each cached head once (with
        # enable_gqa it copies them `group` times: 4x slower at 2k tokens on CPU).
        rows = q.reshape(1, self.num_kv_heads, group * t, self.head_dim)
        return F.scaled_dot_product_attention(
            rows, keys, values, attn_mask=None if mask is None else mask.repeat(group, 1),
        ).view(1, self.num_heads, t, self.head_dim)


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

    def forward(self, x: torch.Tensor, spans: list[Span],  # x: [1, N, hidden]
                caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), spans, caches)
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


class KVCache:
    """One sequence's static KV cache: per layer [kv_heads, max_seq_len, head_dim]
    keys and values, how many positions hold tokens, and their ids (`ids`, in
    position order: what a new request can reuse, CausalLM.cached_ids)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int, ref: torch.Tensor) -> None:
        shape = (cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=ref.dtype, device=ref.device)
                  for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=ref.dtype, device=ref.device)
                  for _ in range(cfg.num_layers)]
        self.length = 0
        self.ids: list[int] = []
        self.tree_start: int | None = None  # a pass with positions not yet kept/rolled back

    @property
    def reusable_ids(self) -> list[int]:
        """ids up to a pending tree pass (whose tokens are not a chain at their indices)."""
        return self.ids if self.tree_start is None else self.ids[:self.tree_start]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} tokens")
        self.length = length
        del self.ids[length:]
        if self.tree_start is not None and length <= self.tree_start:
            self.tree_start = None

    def append(self, ids: list[int], tree: bool = False) -> None:
        """Count tokens a pass has just written at length.. (tree: at positions of
        their own, not yet kept)."""
        if tree and self.tree_start is None:
            self.tree_start = self.length
        self.length += len(ids)
        self.ids += ids

    def snapshot(self) -> CacheSnapshot:
        """A copy of the cached positions' keys/values (up to a pending tree pass)."""
        n = len(self.reusable_ids)
        data = ([k[:, :n].clone() for k in self.k], [v[:, :n].clone() for v in self.v])
        nbytes = sum(t.numel() * t.element_size() for part in data for t in part)
        return CacheSnapshot(list(self.ids[:n]), data, nbytes)

    def restore(self, snap: CacheSnapshot) -> None:
        """Hold exactly what `snap` was taken of (from this model's cache shape)."""
        keys, values = snap.data
        n = len(snap.ids)
        if n > self.k[0].shape[1]:
            raise ValueError(f"a snapshot of {n} tokens does not fit {self.k[0].shape[1]}")
        for cache, saved in zip((*self.k, *self.v), (*keys, *values)):
            cache[:, :n] = saved
        self.length, self.ids, self.tree_start = n, list(snap.ids), None

    def keep(self, indices: Sequence[int], start: int | None) -> None:
        """See CausalLM.keep: the rows at `indices` are copied to start.. (index_select
        copies first, so the rows may overlap their destination)."""
        start = check_keep(indices, start, self.length)
        if indices:
            idx = torch.tensor(list(indices), dtype=torch.long, device=self.k[0].device)
            for cache in (*self.k, *self.v):
                cache[:, start:start + len(idx)] = cache.index_select(1, idx)
        self.ids[start:] = [self.ids[i] for i in indices]
        self.length = start + len(indices)
        self.tree_start = None  # the kept path is a chain at its positions (CausalLM.keep)


class Transformer(nn.Module):
    """A `CausalLM`: decoder weights plus sequence 0's static KV cache; `sequence(i)`
    opens more sequences (each a KVCache of max_seq_len tokens, allocated on first
    use: limits.kv_cache_bytes per sequence, nothing for a user who never opens one)."""

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
        """KV cache (sequence 0) and RoPE tables for max_seq_len tokens, on the weights'
        device and dtype; a ValueError first if they would not fit in the memory left.
        Other sequences are dropped (their caches were for the old device/dtype)."""
        cfg, ref = self.config, self.embed_tokens.weight
        elem = ref.element_size()
        limits.check_memory(
            limits.kv_cache_bytes(cfg, self.max_seq_len, elem)
            + limits.rope_bytes(cfg, self.max_seq_len, elem),
            f"the KV cache of {self.max_seq_len} tokens", str(ref.device))
        self._cache = KVCache(cfg, self.max_seq_len, ref)
        self._sequences: dict[int, TransformerSequence] = {}
        angles = rope_angles(torch.arange(self.max_seq_len, device=ref.device),
                             cfg.head_dim, cfg.rope_theta)  # [max_seq_len, head_dim]
        self.rope_cos = angles.cos().to(ref.dtype)
        self.rope_sin = angles.sin().to(ref.dtype)

    def _apply(self, fn, recurse=True):  # keep cache and RoPE tables with the weights
        super()._apply(fn, recurse)
        if hasattr(self, "_cache"):
            self._allocate_cache()
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
        return self._cache.length

    @property
    def cached_ids(self) -> list[int]:
        """The token ids in the cache, in position order (read only); up to a tree pass
        not yet kept or rolled back."""
        return self._cache.reusable_ids

    def reuse_from(self, common: int, total: int) -> int:
        """Where a prefill of `total` tokens whose first `common` are cached starts:
        a few tokens earlier where the new part is longer than a verification pass
        (65 tokens), so it runs at a prefill_bucket length (a server's shapes stay
        bounded, see prefill_bucket)."""
        if total - common <= 65:
            return common
        return total - prefill_bucket(total - common, total)

    @property
    def k_cache(self) -> list[torch.Tensor]:  # per layer [kv_heads, max_seq_len, head_dim]
        """Sequence 0's cached keys (values: v_cache)."""
        return self._cache.k

    @property
    def v_cache(self) -> list[torch.Tensor]:  # per layer [kv_heads, max_seq_len, head_dim]
        return self._cache.v

    def rollback(self, length: int) -> None:
        self._cache.rollback(length)

    def snapshot(self) -> CacheSnapshot:
        """A copy of this sequence's cache (prefix_store.py)."""
        return self._cache.snapshot()

    def restore(self, snap: CacheSnapshot) -> None:
        """Put a snapshot of this model's caches back (prefix_store.py)."""
        self._cache.restore(snap)

    def keep(self, indices: Sequence[int], *, start: int | None = None) -> None:
        """See CausalLM.keep. Keys were rotated (RoPE) with the positions given at
        forward time and are not rotated again: the token at indices[j] must have
        been run at position start + j (a tree node's depth below the prefix)."""
        self._cache.keep(indices, start)

    def prefill(self, ids: torch.Tensor, *, hidden_layers: Sequence[int] = (),
                hidden_all: bool = False) -> ForwardOutput:  # ids: [T] int64
        self._cache.rollback(0)
        return self.forward(ids, last_n=1, hidden_layers=hidden_layers, hidden_all=hidden_all)

    def forward(
        self,
        ids: torch.Tensor,  # [T] int64
        *,
        last_n: int | None = None,
        hidden_layers: Sequence[int] = (),
        return_hidden: bool = False,
        positions: torch.Tensor | None = None,  # [T] int64
        tree_mask: torch.Tensor | None = None,  # [T, T] bool
        hidden_all: bool = False,
    ) -> ForwardOutput:
        """hidden_all: the hidden states of every new position, the logits of the
        last last_n only (a feature drafter's context after a prefill)."""
        layers = wanted_layers(hidden_layers, return_hidden, len(self.layers))
        return self._run([(self._cache, ids, positions, tree_mask)], last_n, layers,
                         hidden_all)[0]

    def sequence(self, index: int) -> Transformer | TransformerSequence:
        """Sequence `index`: 0 is this model; others get their own KV cache of
        max_seq_len tokens when first opened (memory checked first), kept until
        the weights move (`.to`)."""
        if index == 0:
            return self
        if index < 0:
            raise ValueError(f"sequence index {index} must be >= 0")
        if index not in self._sequences:
            ref = self.embed_tokens.weight
            limits.check_memory(limits.kv_cache_bytes(self.config, self.max_seq_len,
                                                      ref.element_size()),
                                f"the KV cache of sequence {index}", str(ref.device))
            cache = KVCache(self.config, self.max_seq_len, ref)
            self._sequences[index] = TransformerSequence(self, index, cache)
        return self._sequences[index]

    def forward_many(
        self, items: Sequence[tuple[Transformer | TransformerSequence, torch.Tensor]],
        *, last_n: int | None = None, hidden_layers: Sequence[int] = (),
    ) -> list[ForwardOutput]:  # items: (handle, ids [T_i] int64)
        """See CausalLM.forward_many: one pass whose linear layers read the weights once
        for the tokens of all items; attention runs per sequence over its own cache.
        A fresh prompt is padded to its bucket as alone (see prefill_bucket), so prompts
        get bit-identical logits; other passes round as a pass of another shape does
        (float32, SmolLM2-135M: up to 7e-5 on logits up to 35, as a 3-token pass
        against three 1-token passes of one sequence)."""
        caches = [self._cache_of(handle) for handle, _ in items]
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("forward_many: each sequence may appear once")
        layers = wanted_layers(hidden_layers, False, len(self.layers))
        return self._run([(c, ids, None, None) for c, (_, ids) in zip(caches, items)],
                         last_n, layers)

    def _cache_of(self, handle: object) -> KVCache:
        if handle is self:
            return self._cache
        if isinstance(handle, TransformerSequence) and handle.model is self:
            return handle._cache
        raise ValueError("forward_many: every handle must be a sequence of this model")

    # -- the pass ---------------------------------------------------------------

    def _span(self, cache: KVCache, t: int, offset: int, t_run: int,
              positions: torch.Tensor | None,  # [T] int64
              tree_mask: torch.Tensor | None,  # [T, T] bool
              ) -> Span:
        """One sequence's Span: t new tokens (run as t_run rows) at rows offset.. ."""
        start = cache.length
        if start + t > self.max_seq_len:
            raise ValueError(
                f"{start + t} tokens exceed the context limit of {self.max_seq_len}")
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
        return Span(slice(offset, offset + t_run), start, cos, sin, mask)

    @torch.inference_mode()
    def _run(
        self,
        jobs: list[tuple[KVCache, torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
        last_n: int | None,
        layers: tuple[int, ...],
        hidden_all: bool = False,
    ) -> list[ForwardOutput]:
        """One pass over the new tokens of each job (cache, ids [T] int64, positions [T]
        int64 | None, tree_mask [T, T] bool | None), packed in one row block;
        hidden_all (one job only): hidden states of all its rows, logits of last_n."""
        runs, spans, offset = [], [], 0
        for cache, ids, positions, tree_mask in jobs:
            t = ids.shape[0]
            if last_n is not None and not 0 <= last_n <= t:
                raise ValueError(f"last_n={last_n} must be in 0..{t}")
            ids = ids.to(self.device)
            if (cache.length == 0 and t > 1 and positions is None
                    and tree_mask is None and t <= self.max_seq_len):
                # A fresh prompt runs at a bucketed length (see prefill_bucket): the padding
                # comes after it, so causal attention keeps it out of the prompt's rows
                # (and packed with others, the prompt runs as the same shapes as alone).
                ids = torch.cat((ids, ids.new_zeros(prefill_bucket(t, self.max_seq_len) - t)))
            spans.append(self._span(cache, t, offset, ids.shape[0], positions, tree_mask))
            runs.append(ids)
            offset += ids.shape[0]
        rows = [_last_rows(s, ids.shape[0], last_n) for s, (_, ids, _, _) in zip(spans, jobs)]
        if hidden_all and len(jobs) != 1:
            raise ValueError("hidden_all is for one sequence's pass")
        state_rows = ([_last_rows(spans[0], jobs[0][1].shape[0], None)] if hidden_all
                      else rows)
        packed = runs[0] if len(runs) == 1 else torch.cat(runs)  # [N] int64
        x = self.embed_tokens(packed)[None]  # [1, N, hidden]
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, spans, [(c.k[i], c.v[i]) for c, *_ in jobs])
            if i in layers:
                kept[i] = _take(x[0], state_rows).clone()  # not a view keeping all N rows
        for (cache, ids, positions, _) in jobs:  # the padding is overwritten as tokens come
            cache.append(ids.cpu().tolist(), tree=positions is not None)
        hidden = self.norm(_take(x[0], rows))  # [n, hidden]
        logits = self.lm_head(hidden).float()  # [n, vocab]
        if FINAL_LAYER in layers:
            kept[FINAL_LAYER] = self.norm(_take(x[0], state_rows)) if hidden_all else hidden
        return _split(logits, kept, [r.stop - r.start for r in rows])


class TransformerSequence:
    """A handle on one more sequence of a Transformer: its own KVCache on the same
    weights, with the CausalLM methods of the model itself (see Transformer.sequence)."""

    def __init__(self, model: Transformer, index: int, cache: KVCache) -> None:
        self.model, self.index, self._cache = model, index, cache
        self.vocab_size, self.max_seq_len = model.vocab_size, model.max_seq_len
        self.eos_token_ids = model.eos_token_ids

    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)
    cached_len = property(lambda self: self._cache.length)
    cached_ids = property(lambda self: self._cache.reusable_ids)
    reuse_from = property(lambda self: self.model.reuse_from)

    def rollback(self, length: int) -> None:
        self._cache.rollback(length)

    def snapshot(self) -> CacheSnapshot:
        return self._cache.snapshot()

    def restore(self, snap: CacheSnapshot) -> None:
        self._cache.restore(snap)

    def keep(self, indices: Sequence[int], *, start: int | None = None) -> None:
        self._cache.keep(indices, start)

    def prefill(self, ids: torch.Tensor, *, hidden_layers: Sequence[int] = (),
                hidden_all: bool = False) -> ForwardOutput:  # ids: [T] int64
        self._cache.rollback(0)
        return self.forward(ids, last_n=1, hidden_layers=hidden_layers, hidden_all=hidden_all)

    def forward(self, ids: torch.Tensor, *, last_n: int | None = None,  # ids: [T] int64
                hidden_layers: Sequence[int] = (), return_hidden: bool = False,
                positions: torch.Tensor | None = None,  # [T] int64
                tree_mask: torch.Tensor | None = None,  # [T, T] bool
                hidden_all: bool = False,
                ) -> ForwardOutput:
        layers = wanted_layers(hidden_layers, return_hidden, len(self.model.layers))
        return self.model._run([(self._cache, ids, positions, tree_mask)], last_n, layers,
                               hidden_all)[0]

    def sequence(self, index: int) -> Transformer | TransformerSequence:
        return self.model.sequence(index)

    def forward_many(
        self, items: Sequence[tuple[Transformer | TransformerSequence, torch.Tensor]],
        *, last_n: int | None = None, hidden_layers: Sequence[int] = (),
    ) -> list[ForwardOutput]:  # items: (handle, ids [T_i] int64)
        return self.model.forward_many(items, last_n=last_n, hidden_layers=hidden_layers)

    def __repr__(self) -> str:
        return f"TransformerSequence({self.index}, cached_len={self.cached_len})"


def _last_rows(span: Span, t: int, last_n: int | None) -> slice:
    """The rows (of the packed input) of the span's last last_n real tokens."""
    first = span.rows.start
    return slice(first + t - (t if last_n is None else last_n), first + t)


def _take(x: torch.Tensor, rows: list[slice]) -> torch.Tensor:  # x: [N, hidden]
    """The given rows of x, in order (one span: a view, as before packing)."""
    return x[rows[0]] if len(rows) == 1 else torch.cat([x[r] for r in rows])


def _split(logits: torch.Tensor,  # [n, vocab]
           hidden: dict[int, torch.Tensor],  # layer -> [n, hidden]
           sizes: list[int]) -> list[ForwardOutput]:
    """One ForwardOutput per span, of its `sizes[i]` rows."""
    if len(sizes) == 1:
        return [ForwardOutput(logits, hidden_states=dict(hidden))]
    parts = [logits.split(sizes)] + [h.split(sizes) for h in hidden.values()]
    return [ForwardOutput(p[0], hidden_states=dict(zip(hidden, p[1:]))) for p in zip(*parts)]
