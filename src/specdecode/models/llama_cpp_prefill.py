"""Long new parts (prompts) prefilled by a second llama.cpp model in the plain weight layout.

llama.cpp repacks Q4_K/Q4_0/IQ4_NL weights into interleaved layouts (its CPU "extra
buffers") that make one-token steps faster, but on some CPUs its batched kernels over
those layouts are slower than over the plain layout. Measured on a 2-core AMD EPYC
(Zen 5, AVX-512), default target, one process, 1300-token context: one-token step
37 ms repacked vs 44-50 ms plain; a 1300-token prompt 8.8 s repacked vs 5.6 s
plain (130 vs 195-240 tok/s); a 64-token batch 660 vs ~500 ms.

`PrefillCopy` holds a second `LlamaCppLM` over the same GGUF without repacking, its
weights memory-mapped (the file's pages, shared with the page cache), with its own
one-sequence context. `LlamaCppLM` hands it a chain pass of at least `MIN_NEW` new
tokens where moving the cache there and back costs less than it saves (`pays`):
the sequence's cells are copied into the copy's context (llama_state_seq_get/set_data:
the same f16 keys/values, byte for byte), the copy decodes the new tokens, and its
cells are copied back. Short passes (one-token steps, verifications of up to 65
tokens) stay on the repacked weights.

Exactness: the copy's kernels round differently from the repacked ones, as a batch
does from one-token steps; a prompt's keys/values differ in the last bits from a
prefill by the repacked model. Speculative and plain decoding in this engine both
prefill this way, so their outputs are compared over the same cache.

`decide(owner)` says whether the copy pays on this machine: None unless the owner
repacks; else a 128-token pass timed on both (best of three), the copy kept when it
takes at most `KEEP_BELOW` of the repacked time, the answer cached per CPU, library
and GGUF file under $SPECDECODE_CACHE/costs (`planned` reads it for the memory plan).
SPECDECODE_PREFILL_COPY=1/0 forces it on/off. It is not loaded where twice its
memory (mapped weights, KV cache, compute buffer) is not free.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from specdecode import limits
from specdecode.models.base import ForwardOutput

MIN_NEW = 96  # new tokens: below this a pass stays on the repacked weights
TRANSFER_RATIO = 32  # and the new tokens must be >= 1/32 of the sequence after the pass
KEEP_BELOW = 0.8  # the copy is kept when its 128-token pass takes <= 0.8 of the repacked
PROBE_TOKENS = 128


class PrefillCopy:
    """A plain-layout, memory-mapped second model of `owner`'s GGUF (see the module doc)."""

    def __init__(self, owner) -> None:
        from specdecode.models.llama_cpp import LlamaCppLM

        self.lm = LlamaCppLM(owner.path, max_seq_len=owner.max_seq_len,
                             n_threads=owner.n_threads, n_threads_batch=owner.n_threads_batch,
                             n_batch=owner.n_batch, flash_attn=owner.flash_attn,
                             extra_bufts=False, mmap=True, huge_pages=None,
                             prefill_copy=False)

    @staticmethod
    def pays(start: int, new: int) -> bool:
        """Whether a chain pass of `new` tokens after `start` cached ones goes to the copy."""
        return new >= MIN_NEW and new * TRANSFER_RATIO >= start + new

    def run(self, owner, seq, ids: torch.Tensor,  # ids: [T] int64
            last_n: int | None, embeddings: bool) -> ForwardOutput:
        """Decode ids after `seq`'s cells on the copy and put the result in `seq`.
        On an error `seq` is left as it was."""
        mine = self.lm._seq0
        if seq.length:
            self.lm._restore(mine, owner._snapshot(seq))
        else:
            self.lm._rollback(mine, 0)
        try:
            out = self.lm._forward(mine, ids, last_n, embeddings, None, None)
        except Exception:
            self.lm._rollback(mine, 0)
            raise
        owner._restore(seq, self.lm._snapshot(mine))
        return out

    def close(self) -> None:
        self.lm.close()


def decide(owner) -> bool:
    """Whether `owner` (a LlamaCppLM) should prefill through a PrefillCopy (module doc)."""
    forced = os.environ.get("SPECDECODE_PREFILL_COPY", "").strip()
    if forced in ("0", "1"):
        return forced == "1" and owner.extra_bufts
    if not owner.extra_bufts or not _fits(owner):
        return False
    path = _cache_path(owner.path)
    known = _cached(path)
    if known is not None:
        return known
    copy = PrefillCopy(owner)
    try:
        repacked, plain = _probe(owner), _probe(copy.lm)
    finally:
        copy.close()
    keep = plain <= KEEP_BELOW * repacked
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"repacked_s": repacked, "plain_s": plain, "keep": keep,
                                "tokens": PROBE_TOKENS}))
    return keep


def _fits(owner) -> bool:
    """Whether twice the copy's memory (mapped weights, KV cache, compute buffer) is free."""
    need = (Path(owner.path).stat().st_size + owner._kv_cache_bytes(owner.max_seq_len)
            + owner.n_batch * (owner.vocab_size + 4 * owner.hidden_size) * 4)
    avail = limits.available_bytes()
    return avail is None or 2 * need <= avail


def _probe(lm) -> float:
    """Best of three timed passes of PROBE_TOKENS tokens from an empty cache (after
    one untimed); the cache is left empty."""
    ids = torch.arange(PROBE_TOKENS) * 7 % max(2, lm.vocab_size - 1) + 1  # [PROBE] int64
    times = []
    for r in range(4):
        lm.rollback(0)
        start = time.perf_counter()
        lm.forward(ids, last_n=1)
        if r:
            times.append(time.perf_counter() - start)
    lm.rollback(0)
    return min(times)


def planned(gguf: Path) -> bool:
    """Whether a target loaded from this GGUF will have a copy, as far as known without
    measuring (forced, or decided before on this machine): the memory plan's question."""
    forced = os.environ.get("SPECDECODE_PREFILL_COPY", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return bool(_cached(_cache_path(gguf)))


def _cached(path: Path) -> bool | None:
    try:
        return bool(json.loads(path.read_text())["keep"])
    except (OSError, ValueError, KeyError):
        return None


def _cache_path(gguf: Path) -> Path:
    """Per CPU, llama.cpp library and GGUF file (threads: this machine's default)."""
    from specdecode.costs import costs_dir, cpu_name
    from specdecode.models.llama_cpp import use_cached_build

    path = Path(gguf)
    key = "|".join(["prefill-copy", cpu_name(), use_cached_build() or "wheel", path.name,
                    str(path.stat().st_size)])
    return costs_dir() / ("prefill-copy-" + hashlib.sha256(key.encode()).hexdigest()[:20]
                          + ".json")
