"""An EAGLE-3 feature head: one decoder layer over the target's fused hidden states.

The head reads the target's hidden states of a few layers (`aux_layers`, e.g.
2, L/2 and L-3: models.base numbering) at each position p, fuses them with `fc`
(len(aux) * H -> H) into g_p, and runs one decoder layer whose input at
position p is [input_layernorm(embed(x_{p+1})); hidden_norm(g_p)] (2H wide; its
q/k/v projections take 2H, its residual is g_p), attending over its own keys
and values of the positions before (its own KV cache, RoPE at absolute
positions). Its output o_p gives the logits of x_{p+2} (lm_head(norm(o_p))
over a reduced draft vocabulary, `draft_ids[i]` being draft token i's target
id) and, one position on, the feature of the next draft step.

Drafting from the pending token x_{n-1}: the cache holds entries for the
accepted positions 0..n-2 (each from the target's own states: "depth 0");
entry n-2 drafts x_n; then entry n-2+d (d >= 1) takes the drafted token
x_{n-1+d} and the previous entry's output o_{n-3+d} as its feature and drafts
x_{n+d}, attending to the accepted entries and the chain's own (EAGLE-3's
"training-time test" trains exactly this unroll: specdecode.train.eagle_fit).
The chain's entries are dropped after each proposal; the accepted positions
come back as target states and are entered at depth 0.

Parameter names are those of the vLLM `speculators` Eagle-3 checkpoint
(fc, layers.0.*, norm, lm_head), so a head exports to it by renaming nothing
(specdecode.train.speculators). The embedding table is the target's, frozen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters import head_files
from specdecode.drafters.base import BaseDrafter, Draft, DraftContext
from specdecode.drafters.hidden_head import draft_probs, head_timing
from specdecode.models.transformer import RMSNorm, apply_rope, rope_angles
from specdecode.sampling import sample

FORMAT = "specdecode-eagle3-v1"


@dataclass(frozen=True)
class Eagle3Config:
    """Sizes of an EAGLE-3 head and the target layers it reads."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int
    target_vocab_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, ...]:
        """EAGLE-3's choice of a low, a middle and a high layer: vLLM's aux ids
        (2, L/2, L-3) count the residual stream entering decoder layer i; in
        models.base numbering (a layer's output) that is (1, L/2 - 1, L - 4)."""
        return tuple(sorted({min(1, num_layers - 1), max(0, num_layers // 2 - 1),
                             max(0, num_layers - 4)}))


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read the 2H-wide [embedding; feature]."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def keys_values(self, x: torch.Tensor,  # [n, 2H]
                    positions: torch.Tensor,  # [n] int64
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [heads, n, d], k [kv_heads, n, d], v [kv_heads, n, d]), q and k rotated."""
        n, c = x.shape[0], self.cfg
        angles = rope_angles(positions, c.head_dim, c.rope_theta)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        q = self.q_proj(x).view(n, c.num_heads, c.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor,  # [heads, n, d]
               keys: torch.Tensor,  # [kv_heads, m, d]
               values: torch.Tensor,  # [kv_heads, m, d]
               mask: torch.Tensor,  # [n, m] bool, True = may attend
               ) -> torch.Tensor:  # [n, H]
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        out = F.scaled_dot_product_attention(
            q[None], keys.repeat_interleave(group, 0)[None],
            values.repeat_interleave(group, 0)[None], attn_mask=mask[None, None])
        return self.o_proj(out[0].transpose(0, 1).reshape(q.shape[1], -1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """EAGLE-3's first (and only) decoder layer (module docstring)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = Eagle3MLP(cfg)

    def qkv(self, e: torch.Tensor,  # [n, H] embeddings of the next tokens
            g: torch.Tensor,  # [n, H] features
            positions: torch.Tensor,  # [n] int64
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.cat((self.input_layernorm(e), self.hidden_norm(g)), -1)
        return self.self_attn.keys_values(x, positions)

    def finish(self, g: torch.Tensor,  # [n, H] the residual (features)
               attended: torch.Tensor,  # [n, H] the attention's output
               ) -> torch.Tensor:  # [n, H] the layer's output o
        h = g + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The head's parameters (speculators names) and its passes."""

    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor) -> None:  # embed: [V, H]
        super().__init__()
        h = cfg.hidden_size
        if tuple(embed.shape) != (cfg.target_vocab_size, h):
            raise ValueError(f"embedding table {tuple(embed.shape)} does not fit a head for "
                             f"{cfg.target_vocab_size} tokens x {h}")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"{cfg.num_heads} heads do not share {cfg.num_kv_heads} KV heads")
        self.config = cfg
        self.embed = embed.detach()  # frozen, the target's: not a parameter
        self.fc = nn.Linear(len(cfg.aux_layers) * h, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size))  # [Vd] int64

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def embed_of(self, tokens: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, H]
        return self.embed[tokens.to(self.embed.device)].to(self.fc.weight.dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [n, len(aux) * H] -> [n, H]
        return self.fc(aux.to(self.fc.weight.dtype))

    def logits(self, o: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, Vd]
        return self.lm_head(self.norm(o))

    def init_from_target(self, lm_head: torch.Tensor,  # [V, H]
                         draft_ids: torch.Tensor) -> None:  # [Vd] int64
        """lm_head from the target's rows of the draft vocabulary (the other weights
        keep their random start)."""
        with torch.no_grad():
            self.draft_ids.copy_(draft_ids)
            self.lm_head.weight.copy_(lm_head[draft_ids].to(self.lm_head.weight.dtype))

    def save(self, folder: str | Path) -> Path:
        """config.json + model.safetensors (the embedding table is not saved)."""
        return head_files.write(folder, FORMAT, asdict(self.config), self.state_dict())

    @classmethod
    def load(cls, folder: str | Path, embed: torch.Tensor,  # embed: [V, H]
             dtype: torch.dtype = torch.float32) -> Eagle3Head:
        """A head saved by `save`, on the target's embedding table."""
        cfg, state = read_head(folder)
        head = cls(cfg, embed)
        head.load_state_dict(state, strict=True)
        return head.to(dtype).eval()


def read_head(folder: str | Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """(config, weights) of a head saved by Eagle3Head.save, without the target."""
    raw, state = head_files.read(folder, FORMAT)
    raw["aux_layers"] = tuple(raw["aux_layers"])
    return Eagle3Config(**raw), state


class Eagle3Cache:
    """The head's keys/values of accepted positions base..end-1 (depth 0 entries),
    and the output of the last one (what the next chain starts from)."""

    def __init__(self) -> None:
        self.base = self.end = 0
        self.k: torch.Tensor | None = None  # [kv_heads, end - base, d]
        self.v: torch.Tensor | None = None
        self.last_o: torch.Tensor | None = None  # [1, H]
        self.tokens: list[int] = []  # x_0 .. x_end: the tokens the entries read

    def reset(self, base: int) -> None:
        self.base = self.end = base
        self.k = self.v = self.last_o = None
        self.tokens = []

    def rollback(self, end: int) -> None:
        """Keep the entries before `end` (their last output is gone: run one again)."""
        if end <= self.base:
            self.reset(0)
            return
        if end < self.end:
            keep = end - self.base
            self.k, self.v = self.k[:, :keep], self.v[:, :keep]
            self.end, self.last_o = end, None
            del self.tokens[end + 1:]


def enter(head: Eagle3Head, cache: Eagle3Cache,
          aux: torch.Tensor,  # [r, len(aux) * H] target states at positions cache.end..
          next_tokens: torch.Tensor,  # [r] int64 x_{p+1} of each of those positions
          ) -> None:
    """Add depth-0 entries for r accepted positions after the cache's end."""
    r, layer = aux.shape[0], head.layer
    positions = torch.arange(cache.end, cache.end + r)
    g = head.fuse(aux)
    q, k, v = layer.qkv(head.embed_of(next_tokens), g, positions)
    if cache.k is not None:
        k, v = torch.cat((cache.k, k), 1), torch.cat((cache.v, v), 1)
    m = k.shape[1]
    mask = torch.ones(r, m, dtype=torch.bool).tril_(m - r)  # accepted + causal
    o = layer.finish(g, layer.self_attn.attend(q, k, v, mask))
    cache.k, cache.v, cache.end, cache.last_o = k, v, cache.end + r, o[-1:]


def chain(head: Eagle3Head, cache: Eagle3Cache, k: int,
          pick: Callable[[int, torch.Tensor], int], forced: Sequence[int] | None = None,
          ) -> tuple[list[int], list[torch.Tensor]]:
    """The k draft tokens after the cache's entries and each step's logits (k x [Vd]):
    step d's token is `pick(d, logits_d)` (a target id) or `forced[d]` (the
    teacher-forced unroll of the tests), and step d + 1 reads it and step d's output.
    The cache is left as it was."""
    layer, o = head.layer, cache.last_o
    keys, values = cache.k, cache.v
    tokens: list[int] = []
    out: list[torch.Tensor] = []
    for d in range(k):
        out.append(head.logits(o)[0])
        tokens.append(int(forced[d]) if forced is not None else pick(d, out[-1]))
        if d == k - 1:
            break
        position = torch.tensor([cache.end + d])  # the chain's entry d + 1
        q, kk, vv = layer.qkv(head.embed_of(torch.tensor([tokens[-1]])), o, position)
        keys, values = torch.cat((keys, kk), 1), torch.cat((values, vv), 1)
        o = layer.finish(o, layer.self_attn.attend(
            q, keys, values, torch.ones(1, keys.shape[1], dtype=torch.bool)))
    return tokens, out


class Eagle3Drafter(BaseDrafter):
    """Drafts a chain with an Eagle3Head, keeping its cache in step with the
    accepted prefix (module docstring). Greedy requests take the head's argmax;
    sampled ones sample q = the request's warping of the head's logits (placed at
    the target ids) and return q for the verifier's rejection sampling."""

    name = "eagle3"
    priced = True  # one head step per draft token (timing: as a draft model's)
    # Target states kept across passes it was not asked in (a gap longer than that,
    # e.g. a long run of plain steps, restarts the cache from the rows it has).
    context_rows = 64

    def __init__(self, head: Eagle3Head) -> None:
        self.head = head.eval()
        self.hidden_layers = tuple(head.config.aux_layers)
        self.cache = Eagle3Cache()
        self.timing: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    def states_held(self, ids: Sequence[int]) -> int:
        """How many leading positions of `ids` the cache has entries for (the engine
        hands over the target's states from there on: engine._reusable)."""
        common = 0
        for a, b in zip(self.cache.tokens, ids):
            if a != b:
                break
            common += 1
        return max(0, min(common - 1, self.cache.end)) if self.cache.base == 0 else 0

    def begin(self, prompt_ids, params, generator) -> None:
        """Keep the entries whose tokens the new prompt shares (a prefix-cache turn)."""
        self.cache.rollback(self.states_held(prompt_ids))

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        """Up to ctx.k tokens after ctx.tokens; none without the target's states."""
        if ctx.target is None or ctx.k < 1 or any(
                i not in ctx.target.hidden for i in self.hidden_layers):
            return Draft.empty()
        start = time.perf_counter()
        self._catch_up(ctx)
        if self.cache.last_o is None:
            return Draft.empty()
        q_rows: list[torch.Tensor] = []
        times = [start]

        def pick(d: int, logits: torch.Tensor) -> int:  # logits: [Vd]
            if d == 1:
                times.append(time.perf_counter())
            if ctx.params.greedy:
                return int(self.head.draft_ids[logits.argmax()])
            q = draft_probs(logits, self.head.draft_ids, self.head.config.target_vocab_size,
                            ctx.params)
            q_rows.append(q)
            return sample(q, ctx.generator)

        tokens, _ = chain(self.head, self.cache, ctx.k, pick)
        self.timing = head_timing(start, times[-1], len(tokens))
        return Draft(torch.tensor(tokens, dtype=torch.long),
                     torch.stack(q_rows) if q_rows else None)

    def _catch_up(self, ctx: DraftContext) -> None:
        """Enter the accepted positions the cache lacks (up to n - 2) from ctx.target."""
        n, cache = len(ctx.tokens), self.cache
        aux = torch.cat([ctx.target.hidden[i] for i in self.hidden_layers], -1)  # [R, LH]
        first = n - 1 - aux.shape[0]  # position of the first row
        if cache.end < first or cache.end > n - 1:
            cache.reset(first)
        if cache.end == n - 1 and cache.last_o is not None:
            return
        if cache.end == n - 1:  # its last output is gone: enter the last position again
            cache.rollback(n - 2)
            if cache.end != n - 2:
                cache.reset(first)
        rows = aux[cache.end - first:]
        enter(self.head, cache, rows, torch.tensor(ctx.tokens[cache.end + 1:n]))
        cache.tokens = ctx.tokens[:n]

