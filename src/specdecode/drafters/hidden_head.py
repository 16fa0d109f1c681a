"""A trained head that drafts from the target's final hidden state (no attention, no cache).

The head reads what every backend exposes, the target's final hidden state
(models.base FINAL_LAYER: after the last norm), at the position that scored
the pending token x, and drafts a chain: one step maps (feature f_t, token
x_{t+1}) to (feature f_{t+1}, logits of x_{t+2}) as

    z = fc([norm_e(embed(x_{t+1})); norm_f(f_t)])        (2H -> H)
    f_{t+1} = z + mlp(norm_m(z))                          (SwiGLU, H -> I -> H)
    logits = lm_head(norm(f_{t+1}))                       (H -> draft vocabulary)

f_0 is the target's hidden state; deeper steps feed the head's own feature
and its own drafted token (EAGLE's feature recursion, without its decoder
layer's attention: a step needs only the last accepted position, so nothing
has to be kept in step with the accepted prefix and the llama.cpp backend,
which exposes only the final state, can feed it). The embedding table is the
target's (frozen, not part of the head's file); the lm_head covers a reduced
draft vocabulary, `d2t[i]` being draft token i's target id (EAGLE-3's
d2t/t2d, here as absolute ids). Training: specdecode.train.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdecode.drafters import head_files
from specdecode.drafters.base import BaseDrafter, Draft, DraftContext
from specdecode.models.base import FINAL_LAYER
from specdecode.models.transformer import RMSNorm
from specdecode.sampling import logits_to_probs, sample

FORMAT = "specdecode-hidden-head-v1"


@dataclass(frozen=True)
class HeadConfig:
    """Sizes of a head: the target's hidden size and vocabulary, its own MLP width
    and draft vocabulary."""

    hidden_size: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-6


class HiddenStateHead(nn.Module):
    """The head's parameters and one draft step (module docstring)."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor) -> None:  # embed: [V, H]
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if tuple(embed.shape) != (cfg.target_vocab_size, h):
            raise ValueError(f"embedding table {tuple(embed.shape)} does not fit a head for "
                             f"{cfg.target_vocab_size} tokens x {h}")
        self.config = cfg
        self.embed = embed.detach()  # frozen, shared with the target: not a parameter
        self.norm_e, self.norm_f = RMSNorm(h, eps), RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm_m = RMSNorm(h, eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))  # [Vd] int64

    @property
    def draft_ids(self) -> torch.Tensor:  # [Vd] int64: draft token i's target id
        return self.d2t

    def step(self, feature: torch.Tensor,  # [n, H]
             tokens: torch.Tensor,  # [n] int64, target ids
             ) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, H], [n, Vd] logits)
        """One draft step for n independent positions."""
        dtype = self.fc.weight.dtype
        e = self.embed[tokens.to(self.embed.device)].to(dtype)
        z = self.fc(torch.cat((self.norm_e(e), self.norm_f(feature.to(dtype))), -1))
        z = z + self.down(nn.functional.silu(self.gate(self.norm_m(z))) * self.up(
            self.norm_m(z)))
        return z, self.lm_head(self.norm(z))

    def init_from_target(self, lm_head: torch.Tensor, d2t: torch.Tensor) -> None:
        """Start the lm_head from the target's rows of the draft vocabulary
        (lm_head: [V, H]; d2t: [Vd] int64 target ids) and fc as the identity on the
        feature: an untrained head then drafts roughly the target's next token."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.lm_head.weight.copy_(lm_head[d2t].to(self.lm_head.weight.dtype))
            h = self.config.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.down.weight.zero_()

    def save(self, folder: str | Path) -> Path:
        """config.json + model.safetensors (the embedding table is not saved)."""
        state = {k: v for k, v in self.state_dict().items() if k != "embed"}
        return head_files.write(folder, FORMAT, asdict(self.config), state)

    @classmethod
    def load(cls, folder: str | Path, embed: torch.Tensor,  # embed: [V, H]
             dtype: torch.dtype = torch.float32) -> HiddenStateHead:
        """A head saved by `save`, on the target's embedding table."""
        raw, state = head_files.read(folder, FORMAT)
        head = cls(HeadConfig(**raw), embed)
        head.load_state_dict(state, strict=True)
        return head.to(dtype).eval()


def target_embedding(target, path: str | Path) -> torch.Tensor:  # -> [V, H]
    """The target's token embedding table: a torch model's own tensor, else read
    from its GGUF file (float16)."""
    if hasattr(target, "embed_tokens"):
        return target.embed_tokens.weight
    from specdecode.models.loading import gguf_tensors
    return gguf_tensors(path, ["token_embd.weight"])["token_embd.weight"]


class HiddenHeadDrafter(BaseDrafter):
    """Drafts a chain with a HiddenStateHead from the target's final hidden state.

    Greedy requests take the head's argmax; sampled ones sample from q = the
    request's warping (logits_to_probs) of the head's logits over the draft
    vocabulary, placed at the target ids (0 elsewhere), and return q so the
    verifier's rejection sampling keeps the target's distribution."""

    name = "hidden-head"
    hidden_layers = (FINAL_LAYER,)
    priced = True  # one head step per draft token (timing: as a draft model's)

    def __init__(self, head: HiddenStateHead) -> None:
        self.head = head.eval()
        self.timing: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        """Up to ctx.k tokens after ctx.tokens; none without the target's state."""
        if ctx.target is None or FINAL_LAYER not in ctx.target.hidden or ctx.k < 1:
            return Draft.empty()
        feature = ctx.target.hidden[FINAL_LAYER][-1:]  # [1, H]
        token = torch.tensor([ctx.tokens[-1]])  # [1] int64
        tokens, q_rows = [], []
        start = first = time.perf_counter()
        for i in range(ctx.k):
            if i == 1:
                first = time.perf_counter()
            feature, logits = self.head.step(feature, token)
            if ctx.params.greedy:
                token = self.head.d2t[logits[0].argmax()].view(1)
            else:
                q = draft_probs(logits[0], self.head.d2t, self.head.config.target_vocab_size,
                                ctx.params)  # [target_vocab]
                token = torch.tensor([sample(q, ctx.generator)])
                q_rows.append(q)
            tokens.append(int(token))
        self.timing = head_timing(start, first, len(tokens))
        return Draft(torch.tensor(tokens, dtype=torch.long),
                     torch.stack(q_rows) if q_rows else None)


def head_timing(start: float, first: float, n: int) -> tuple[int, float, int, float]:
    """A head's proposal cost in a draft model's `timing` form: (1 token fed, the first
    step's seconds with its catch-up, the n - 1 steps after it, their seconds)."""
    now = time.perf_counter()
    return (1, (first if n > 1 else now) - start, n - 1, now - first if n > 1 else 0.0)


def draft_probs(logits: torch.Tensor,  # [Vd] a head's logits over its draft vocabulary
                draft_ids: torch.Tensor,  # [Vd] int64 their target ids
                vocab_size: int, params) -> torch.Tensor:  # [vocab_size] float32
    """q: the request's warping (logits_to_probs) of a head's logits, placed at the
    target ids (0 elsewhere), for the verifier's rejection sampling."""
    q = torch.zeros(vocab_size)
    q[draft_ids] = logits_to_probs(logits, params)
    return q
