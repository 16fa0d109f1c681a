"""Training an EAGLE-3 head (drafters/eagle.py) on self-distilled context shards.

A shard (data.answer_with_context) is one window of a conversation: ids x_s ..
x_{s+T}, the target's aux states at x_s .. x_{s+T-1}, and where the target's
own answer starts. "Training-time test": the head's unroll is run for all
positions at once, `depths` times. At depth 0 entry p reads the target's fused
state g_p and the token x_{p+1}, attending causally to depth-0 entries; at
depth d entry p stands for the d-th chain step from anchor a = p - d: it reads
x_{p+1} and depth d-1's output at p - 1, and attends to the depth-0 entries
0..a and to the chain's own entries, depth j's at a + j (j = 1..d). Every
entry p is scored by cross-entropy on x_{p+2} where that is an answer token
(the target's greedy token: the one a draft must hit; with soft labels the
target's distribution there, Shard.soft_targets) and the anchor is in the
window; depth d weighted fit.DEPTH_DECAY**d. drafters/eagle.py `chain` runs
exactly this with the drafted tokens (tests/test_eagle.py checks it). Anchors
whose chain cannot reach an answer token (before first_anchor: the prompt tail)
get no query and no deeper step; their depth-0 keys and values are still the
context (a step 1.36x faster with 128-row prompt tails: bench/train_step.py).
A batch's windows are unrolled together (packed_logits: one pass per depth over
all of them, attention kept inside each window, the lm_head once), the same
numbers as each window apart in fewer, larger matrix products.

Validation: greedy chain acceptance per depth from every anchor whose first
drafted token is an answer token (a missing label counts as a miss), and
tau = 1 + sum(accept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.drafters.eagle import Eagle3Config, Eagle3Head
from specdecode.train.fit import DEPTH_DECAY


@dataclass(frozen=True)
class Layout:
    """Windows' rows laid end to end for one unroll (packed_logits). window / row:
    [R] int64, each row's window and its row in it; positions: [R] int64, the
    rows' positions in their conversations; anchors: per depth d, [N_d] int64 the
    rows (of this layout) of the anchors that get a depth-d step, in order: a
    window's from its `first` to t - 1 - d."""

    window: torch.Tensor
    row: torch.Tensor
    positions: torch.Tensor
    anchors: list[torch.Tensor]

    @classmethod
    def of(cls, windows: Sequence[tuple[int, int, int]], depths: int) -> Layout:
        """windows: (rows t, start, first anchor) each; anchors for depths 0 ..
        depths - 1, stopping at the first depth no window reaches."""
        ts = [t for t, _, _ in windows]
        offsets = [sum(ts[:i]) for i in range(len(ts))]
        anchors = []
        for d in range(depths):
            rows = [torch.arange(o + f, o + t - d) for o, (t, _, f) in zip(offsets, windows)
                    if t - d > f]
            if not rows:
                break
            anchors.append(torch.cat(rows))
        return cls(torch.cat([torch.full((t,), i) for i, t in enumerate(ts)]),
                   torch.cat([torch.arange(t) for t in ts]),
                   torch.cat([torch.arange(s, s + t) for t, s, _ in windows]), anchors)

    def mask(self, depth: int) -> torch.Tensor:  # -> [N_depth, R + N_1 + .. + N_depth] bool
        """Which keys depth `depth`'s entries attend to, one row per anchor a: the
        depth-0 keys of a's window up to a, then for j = 1..depth depth j's key at
        a (itself last)."""
        a = self.anchors[depth][:, None]
        blocks = [(self.window[None, :] == self.window[a]) & (torch.arange(len(self.row)) <= a)]
        blocks += [self.anchors[j][None, :] == a for j in range(1, depth + 1)]
        return torch.cat(blocks, 1)


def first_anchor(answer_start: int, depths: int) -> int:
    """The first anchor whose chain of `depths` steps scores an answer token (step d
    from anchor a scores x_{a+d+2}): the training unroll leaves earlier ones out."""
    return max(0, answer_start - depths - 1)


def packed_logits(head: Eagle3Head,
                  windows: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]],
                  depths: int) -> list[torch.Tensor]:  # depth d: [N_d, Vd]
    """Each depth's logits per anchor of several windows unrolled together (one
    pass per depth, the lm_head once): windows are (aux [T, len(aux_layers) * H],
    ids [T + 1] int64 x_s .. x_{s+T}, start s, first anchor); row i of depth d is
    Layout.anchors[d][i]'s chain step d (entry p = a + d, scoring x_{s+p+2}). The
    same numbers as unrolled_logits per window: attention never crosses windows
    (Layout.mask). Depth 0 runs the layer's keys and values over every row (the
    context), deeper steps and the lm_head only over the anchors kept."""
    layer = head.layer
    lay = Layout.of([(len(aux), s, f) for aux, _, s, f in windows], depths)
    e = head.embed_of(torch.cat([ids[1:] for _, ids, _, _ in windows]))
    g = head.fuse(torch.cat([aux for aux, _, _, _ in windows]))
    keys, values, outs = [], [], []
    for d, anchors in enumerate(lay.anchors):
        if d == 0:  # keys and values of every row, queries of the anchors kept
            q, k, v = layer.qkv(e, g, lay.positions)
            q, g = q[:, anchors], g[anchors]
        else:  # depth d at anchor a reads depth d-1's output at a
            g = outs[-1][torch.searchsorted(lay.anchors[d - 1], anchors)]
            q, k, v = layer.qkv(e[anchors + d], g, lay.positions[anchors + d])
        keys.append(k)
        values.append(v)
        outs.append(layer.finish(g, layer.self_attn.attend(
            q, torch.cat(keys, 1), torch.cat(values, 1), lay.mask(d))))
    return list(head.logits(torch.cat(outs)).split([len(o) for o in outs]))


def unrolled_logits(head: Eagle3Head, aux: torch.Tensor,  # [T, len(aux_layers) * H]
                    ids: torch.Tensor,  # [T + 1] int64 x_s .. x_{s+T}
                    start: int, depths: int, first: int = 0,
                    ) -> list[torch.Tensor]:  # depth d < T - first: [T - first - d, Vd]
    """packed_logits of one window: row i of depth d is chain step d from anchor
    a = first + i."""
    return packed_logits(head, [(aux, ids, start, first)], depths)


@dataclass
class Shard:
    """One window: aux [T, LH] as stored (float16: half the memory of float32 for
    a run's thousands of windows), ids [T + 1] int64,
    answer_start, start (data.py); scale [LH] or None: what `features` multiplies
    aux by (scale_windows); greedy [T] int64 or None: a sampled answer's greedy
    token at each row (data.BatchPlan.samples), its labels in place of ids;
    top_ids / top_logp or None: the target's distribution at each row, its K most
    likely ids (data.top_of), what soft labels are made of."""

    aux: torch.Tensor
    ids: torch.Tensor
    answer_start: int
    start: int
    scale: torch.Tensor | None = None
    greedy: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None  # [T, K] int32 (data.top_of; -1 unscored rows)
    top_logp: torch.Tensor | None = None  # [T, K] float16

    def features(self) -> torch.Tensor:  # -> [T, LH] float32
        """What the head trains on: aux in float32, times scale when set."""
        aux = self.aux.float()
        return aux if self.scale is None else aux * self.scale

    def labels(self, t2d: torch.Tensor, depth: int) -> torch.Tensor:  # -> [T] int64
        """Draft ids of x_{p+2} for each entry p of `depth` (-100: not scored): of
        the target's greedy token at row p + 1 for a sampled answer's window (the
        token a draft must hit after x_{p+1}; x_{p+2} itself was drawn)."""
        t = self.aux.shape[0]
        nxt = torch.full((t,), -1, dtype=torch.long)
        nxt[: max(0, t - 1)] = self.ids[2:t + 1] if self.greedy is None else self.greedy[1:t]
        p = torch.arange(t)
        ok = (nxt >= 0) & (p + 2 >= self.answer_start) & (p >= depth)
        return torch.where(ok, t2d[nxt.clamp(min=0)], -100)

    def soft_targets(self, t2d: torch.Tensor, depth: int,  # t2d: [V] int64
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # -> ([T, K] int64, [T, K])
        """Soft labels of each entry p of `depth`: the target's distribution over x_{p+2}
        (its K most likely ids at row p + 1) as draft ids and float32 weights, renormalised
        over the ids inside the draft vocabulary. Rows `labels` does not score weigh 0;
        an id outside the draft vocabulary weighs 0 (its draft id reads 0)."""
        t, k = self.top_ids.shape
        ids = torch.full((t, k), -1, dtype=torch.long)
        logp = torch.zeros(t, k)
        ids[: max(0, t - 1)] = self.top_ids[1:t].long()
        logp[: max(0, t - 1)] = self.top_logp[1:t].float()
        draft = torch.where(ids >= 0, t2d[ids.clamp(min=0)], -100)
        w = torch.where(draft >= 0, logp.exp(), 0.0) * (self.labels(t2d, depth) >= 0)[:, None]
        return draft.clamp(min=0), w / w.sum(-1, keepdim=True).clamp(min=1e-30)


def load_windows(paths: Sequence) -> list[Shard]:
    """The non-empty shards of data.answer_with_context files."""
    from safetensors.torch import load_file
    out = []
    for path in paths:
        t = load_file(str(path))
        if t["aux"].shape[0] >= 2:
            out.append(Shard(t["aux"], t["ids"], int(t["answer_start"][0]),
                             int(t["start"][0]), greedy=t.get("greedy"),
                             top_ids=t.get("top_ids"), top_logp=t.get("top_logp")))
    return out


def input_scale(shards: Sequence[Shard]) -> torch.Tensor:  # -> [LH]
    """Per aux column, 1 / its root mean square over the windows' rows. A target's
    inner states carry a few columns thousands of times larger than the rest
    (4416 against a mean of 1 on the default target), which made fc's Adam steps
    swamp its output: training reads aux * scale, and fold_scale puts the scale
    into fc afterwards, so the saved head reads the target's raw states."""
    squares = sum((w.aux.double() ** 2).sum(0) for w in shards)
    rows = sum(w.aux.shape[0] for w in shards)
    return (squares / max(rows, 1)).sqrt().clamp(min=1e-3).reciprocal().float()


def scale_windows(shards: Sequence[Shard], scale: torch.Tensor) -> None:  # scale: [LH]
    """Set each window's scale (its features are then aux * scale: input_scale)."""
    for w in shards:
        w.scale = scale


def fold_scale(head: Eagle3Head, scale: torch.Tensor) -> None:  # scale: [LH]
    """fc(aux * scale) == fc'(aux): scale fc's input columns by `scale`."""
    with torch.no_grad():
        head.fc.weight.mul_(scale.to(head.fc.weight.dtype)[None, :])


@dataclass
class Sequences:
    """A set of windows for fit.fit: `sample` draws windows, `loss` and
    `acceptance` are the module docstring's; depths: unrolled steps; soft: the loss
    is the cross-entropy against the target's distribution (Shard.soft_targets) in
    windows that hold it, instead of against its greedy token."""

    shards: list[Shard]
    depths: int
    soft: bool = False

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def answer_tokens(self) -> int:
        """Answer tokens of these windows (the positions the loss scores)."""
        return sum(int(len(s.ids) - s.answer_start) for s in self.shards)

    def sample(self, gen: torch.Generator, batch: int) -> Sequences:
        """Windows drawn at random until about `batch` entries (at least one)."""
        picked, rows = [], 0
        while rows < batch or not picked:
            shard = self.shards[int(torch.randint(len(self.shards), (1,), generator=gen))]
            picked.append(shard)
            rows += shard.aux.shape[0]
        return Sequences(picked, self.depths, self.soft)

    def loss(self, head: Eagle3Head, t2d: torch.Tensor) -> torch.Tensor:
        """The unrolled loss of these windows, unrolled together (packed_logits): depth
        d's cross-entropy summed over its scored entries, weighted DEPTH_DECAY**d,
        over the number of depth-0 entries scored."""
        firsts = [first_anchor(s.answer_start, self.depths) for s in self.shards]
        logits = packed_logits(head, [(s.features(), s.ids, s.start, f)
                                      for s, f in zip(self.shards, firsts)], self.depths)
        total, count = torch.zeros(()), 0
        for d, rows in enumerate(logits):
            parts = [self._targets(s, t2d, d, f) for s, f in zip(self.shards, firsts)]
            width = max(ids.shape[1] for ids, _, _ in parts)
            draft = torch.cat([_pad(ids, width) for ids, _, _ in parts])
            weight = torch.cat([_pad(w, width) for _, w, _ in parts])
            logp = torch.log_softmax(rows.float(), -1).gather(1, draft)
            total = total - DEPTH_DECAY ** d * (weight * logp).sum()
            count += sum(n for _, _, n in parts) if d == 0 else 0
        return total / max(1, count)

    def _targets(self, shard: Shard, t2d: torch.Tensor, d: int, first: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:  # ([n, K] int64, [n, K], n)
        """What depth d's entries of `shard` (its anchors from `first`) are scored
        against: draft ids and weights (the greedy label with weight 1, or with
        `soft` the target's distribution where the window holds it; unscored rows
        weigh 0), and how many entries are scored."""
        labels = shard.labels(t2d, d)[first + d:]
        scored = labels >= 0
        if self.soft and shard.top_ids is not None:
            draft, w = (x[first + d:] for x in shard.soft_targets(t2d, d))
        else:
            draft, w = labels.clamp(min=0)[:, None], scored.float()[:, None]
        return draft, w, int(scored.sum())

    @torch.no_grad()
    def chain_lengths(self, head: Eagle3Head) -> list[torch.Tensor]:
        """Per shard, [anchors] int64: how many of the greedy chain's first
        `depths` steps from each answer anchor match the target's own tokens."""
        out = []
        for shard in self.shards:
            first = first_anchor(shard.answer_start, self.depths)
            logits = unrolled_logits(head, shard.features(), shard.ids, shard.start,
                                     self.depths, first)
            t = shard.aux.shape[0]
            nxt = torch.full((t + self.depths,), -2, dtype=torch.long)
            nxt[: t - 1] = shard.ids[2:t + 1]
            a = torch.arange(max(0, shard.answer_start - 2), t - 1)  # anchors
            alive = torch.ones(len(a), dtype=torch.bool)
            length = torch.zeros(len(a), dtype=torch.long)
            for d, rows in enumerate(logits):
                p = a + d
                drafted = head.draft_ids[rows[(a - first).clamp(max=len(rows) - 1)].argmax(-1)]
                alive &= (p < t) & (drafted == nxt[p])
                length += alive
            out.append(length)
        return out

    def acceptance(self, head: Eagle3Head) -> list[float]:
        """accept[d]: share of anchors whose first d + 1 greedy chain steps all match."""
        lengths = torch.cat(self.chain_lengths(head))
        return [float((lengths > d).float().mean()) if len(lengths) else 0.0
                for d in range(self.depths)]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:  # [n, K] -> [n, width]
    """x with zero columns appended up to `width` (id 0 with weight 0: no term)."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def walked_tau(lengths: Sequence[torch.Tensor], k: int) -> float:  # lengths: per shard [anchors]
    """Tokens per verification step of greedy speculation with k-token chains, walking
    each answer as the engine does (a step after L accepted tokens starts L + 1 on).
    Lower than 1 + sum(accept[:k]), which weighs every anchor alike: the engine
    skips the anchors inside an accepted run, and those are the easy ones."""
    tokens = steps = 0
    for length in lengths:
        i, chain = 0, length.clamp(max=k).tolist()
        while i < len(chain):
            tokens, steps, i = tokens + chain[i] + 1, steps + 1, i + chain[i] + 1
    return tokens / max(1, steps)


def new_head(embed: torch.Tensor,  # [V, H] the target's embedding table
             lm_head: torch.Tensor,  # [V, H] the target's output projection
             draft_ids: torch.Tensor,  # [Vd] int64
             target_cfg, aux_layers: Sequence[int] | None = None,
             intermediate: int | None = None) -> Eagle3Head:
    """An EAGLE-3 head shaped like one of the target's layers (heads, KV heads,
    head size, RoPE base; target_cfg: models.config.ModelConfig), its lm_head
    started from the target's rows. intermediate: its MLP width (None: the
    target's; a narrower one trains and drafts for less)."""
    v, h = embed.shape
    layers = tuple(aux_layers or Eagle3Config.default_layers(target_cfg.num_layers))
    width = intermediate or target_cfg.intermediate_size
    cfg = Eagle3Config(h, width, target_cfg.num_heads,
                       target_cfg.num_kv_heads, target_cfg.head_dim, len(draft_ids), v,
                       layers, target_cfg.rms_norm_eps, target_cfg.rope_theta)
    head = Eagle3Head(cfg, embed)
    head.init_from_target(lm_head, draft_ids)
    return head
