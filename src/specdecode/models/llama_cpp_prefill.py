"""Long passes (prompts, a new turn, long verifications) run by a second llama.cpp model
in the plain weight layout.

llama.cpp repacks Q4_K/Q4_0/IQ4_NL weights into interleaved layouts (its CPU "extra
buffers") that make one-token steps faster, but on some CPUs its batched kernels over
those layouts are slower than over the plain layout. Measured on a 2-core AMD EPYC
(Zen 5, AVX-512), default target, one process: a 1300-token prompt 11.5 s repacked
vs 7.4 s plain (median of 5, interleaved); one-token step 37 ms repacked vs 44-50 ms
plain; after a 300-token context, 65 tokens 17.2 plain steps repacked vs 12.5 on
the copy, 17 tokens 6.0 vs 7.1.

`PrefillCopy` holds a second `LlamaCppLM` over the same GGUF without repacking, its
weights memory-mapped (the file's pages, shared with the page cache), with its own
one-sequence context. `LlamaCppLM` hands it a chain pass of at least `min_new` new
tokens where moving the cache there and back costs less than it saves (`pays`):
the sequence's cells are copied into the copy's context (llama_state_seq_get/set_data:
the same f16 keys/values, byte for byte, through one reused buffer: ~3.5 ms each
way per 1500 cached tokens of the default target), the copy decodes the new tokens,
and its cells are copied back. Shorter passes (one-token steps, short
verifications) stay on the repacked weights.

Exactness: the copy's kernels round differently from the repacked ones, as a batch
does from one-token steps: a prompt's keys/values differ in the last bits from a
repacked prefill's, and a long verification's logits from one-token steps'. Plain
and speculative decoding in this engine both prefill this way.

`decide(owner)` says from which pass length the copy pays on this machine (None:
never): nothing unless the owner repacks; else passes of `PROBE_SIZES` tokens timed
on both (best of two after one untimed), `min_new` the smallest size from which on
the copy takes at most `KEEP_BELOW` of the repacked time; cached per CPU, library
and GGUF file under $SPECDECODE_CACHE/costs (`planned` reads it for the memory
plan). `open_copy` loads the copy decided on, keeping the one a first measurement
loaded rather than loading it again. SPECDECODE_PREFILL_COPY=1 forces it on
(prompts only: `FORCED_MIN_NEW`, also where nothing is repacked), 0 off. It is
not loaded where twice its memory (mapped weights, KV cache, compute buffer) is
not free (forced or not; only `LlamaCppLM(prefill_copy=True)` skips the checks).
Sizes at or above the context are not timed. The decision is not re-measured when
the machine is busy later; the cache key has no threads or flash-attention setting
(both as the owner's).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdecode import limits
from specdecode.cachefile import write_atomic
from specdecode.models.base import ForwardOutput

if TYPE_CHECKING:
    from specdecode.models.llama_cpp import LlamaCppLM, _Seq

PROBE_SIZES = (17, 33, 65, 128)  # pass lengths timed on both layouts
KEEP_BELOW = 0.85  # a size goes to the copy when it takes <= 0.85 of the repacked time
FORCED_MIN_NEW = 96  # forced on without a measurement: prompts and new turns only
# A pass goes to the copy only when the new tokens are >= 1/100 of the cache after
# it: the moves cost ~2.5 ms per 1000 cached tokens each way (default target), the
# copy saves ~1.5-5 ms per new token from 33 tokens on (module doc's numbers).
TRANSFER_RATIO = 100


class PrefillCopy:
    """A plain-layout, memory-mapped second model of `owner`'s GGUF (see the module doc)."""

    def __init__(self, owner: LlamaCppLM, min_new: int = FORCED_MIN_NEW) -> None:
        from specdecode.models.llama_cpp import LlamaCppLM

        self.min_new = min_new
        self.lm = LlamaCppLM(owner.path, max_seq_len=owner.max_seq_len,
                             n_threads=owner.n_threads, n_threads_batch=owner.n_threads_batch,
                             n_batch=owner.n_batch, flash_attn=owner.flash_attn,
                             extra_bufts=False, mmap=True, huge_pages=None,
                             prefill_copy=False)
        self._buffer = np.empty(0, dtype=np.uint8)  # reused by every move

    def pays(self, start: int, new: int) -> bool:
        """Whether a chain pass of `new` tokens after `start` cached ones goes to the copy."""
        return new >= self.min_new and new * TRANSFER_RATIO >= start + new

    def run(self, owner: LlamaCppLM, seq: _Seq, ids: torch.Tensor,  # ids: [T] int64
            last_n: int | None, embeddings: bool) -> ForwardOutput:
        """Decode ids after `seq`'s cells on the copy and put the result in `seq`.
        An error in the copy's pass leaves `seq` as it was; one in moving the cells
        back (a RuntimeError, not seen so far) leaves it empty."""
        mine = self.lm._seq0
        self._move(owner, seq, self.lm, mine)
        try:
            out = self.lm._forward(mine, ids, last_n, embeddings, None, None)
        except Exception:
            self.lm._rollback(mine, 0)
            raise
        self._move(self.lm, mine, owner, seq)
        return out

    def _move(self, src: LlamaCppLM, src_seq: _Seq, dst: LlamaCppLM, dst_seq: _Seq) -> None:
        """Replace dst_seq's cells by src_seq's (two LlamaCppLMs of the same GGUF); a
        RuntimeError, dst_seq empty, if llama.cpp copies less than the whole state."""
        dst._rollback(dst_seq, 0)
        if src_seq.length:
            self._buffer, written = src._read_cells(src_seq, self._buffer)
            if not dst._write_cells(dst_seq, self._buffer, written):
                dst._rollback(dst_seq, 0)
                raise RuntimeError(f"llama.cpp could not move sequence {src_seq.seq_id}")
        dst_seq.length, dst_seq.ids = src_seq.length, list(src_seq.ids)

    def close(self) -> None:
        """Free the copy's model and context."""
        self.lm.close()


def open_copy(owner: LlamaCppLM, wanted: bool | None) -> PrefillCopy | None:
    """`owner`'s PrefillCopy: always (wanted True: from FORCED_MIN_NEW tokens on, no
    checks), never (False), or as `decide` says (None); the copy a first measurement
    loaded is the one kept, not loaded again."""
    if wanted:
        return PrefillCopy(owner)
    if wanted is False:
        return None
    min_new, measured = _decide(owner)
    if not min_new:
        if measured is not None:
            measured.close()
        return None
    if measured is None:
        try:
            return PrefillCopy(owner, min_new)
        except (RuntimeError, ValueError, OSError):
            return None  # a speed-up, never a condition (decide)
    measured.min_new = min_new
    return measured


def decide(owner: LlamaCppLM) -> int | None:
    """From which pass length `owner` should use a PrefillCopy; None: never (module
    doc). A measurement that fails (too small a context, no memory, an unwritable
    cache) is None, not an error: the copy is a speed-up, never a condition."""
    min_new, measured = _decide(owner)
    if measured is not None:
        measured.close()
    return min_new


def _decide(owner: LlamaCppLM) -> tuple[int | None, PrefillCopy | None]:
    """decide's answer and, where it measured, the copy it measured (open)."""
    forced = _forced()
    if forced == "0" or not _fits(owner):
        return None, None
    if forced == "1":
        return FORCED_MIN_NEW, None
    if not owner.extra_bufts:
        return None, None
    path = _cache_path(owner.path)
    known = _cached(path)
    if known is not None:
        return known.get("min_new"), None
    sizes = [n for n in PROBE_SIZES if n < owner.max_seq_len]
    try:
        copy = PrefillCopy(owner)
    except (RuntimeError, ValueError, OSError):
        return None, None
    try:
        min_new, record = _measure(owner, copy, sizes)
    except (RuntimeError, ValueError, OSError):
        copy.close()
        return None, None
    except BaseException:
        copy.close()
        raise
    write_atomic(path, json.dumps(record))  # best effort: measured again where it fails
    return min_new, copy


def _measure(owner: LlamaCppLM, copy: PrefillCopy, sizes: list[int]
             ) -> tuple[int | None, dict]:
    """(min_new, the record cached): each size timed on both layouts (the copy's
    cache is left empty)."""
    repacked = {n: _probe(owner, n) for n in sizes}
    plain = {n: _probe(copy.lm, n) for n in sizes}
    min_new = None
    for n in sorted(sizes, reverse=True):  # the smallest size from which on it pays
        if plain[n] > KEEP_BELOW * repacked[n]:
            break
        min_new = n
    return min_new, {"repacked_s": repacked, "plain_s": plain, "min_new": min_new}


def planned(gguf: Path) -> bool:
    """Whether a target loaded from this GGUF will have a copy, as far as known without
    measuring (forced, or decided before on this machine): the memory plan's question."""
    forced = _forced()
    if forced is not None:
        return forced == "1"
    known = _cached(_cache_path(gguf))
    return bool(known and known.get("min_new"))


def _forced() -> str | None:
    """SPECDECODE_PREFILL_COPY's "0" or "1"; None when unset or anything else."""
    value = os.environ.get("SPECDECODE_PREFILL_COPY", "").strip()
    return value if value in ("0", "1") else None


def _cached(path: Path) -> dict | None:
    """The decision cached at path, if there is a readable one."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "min_new" in record else None


def _fits(owner: LlamaCppLM) -> bool:
    """Whether twice the copy's memory (mapped weights, KV cache, compute buffer) is free."""
    need = (Path(owner.path).stat().st_size + owner._kv_cache_bytes(owner.max_seq_len)
            + owner.n_batch * (owner.vocab_size + 4 * owner.hidden_size) * 4)
    avail = limits.available_bytes()
    return avail is None or 2 * need <= avail


def _probe(lm: LlamaCppLM, n: int) -> float:
    """Best of two timed passes of n tokens from an empty cache (after one untimed);
    the cache is left empty."""
    ids = torch.arange(n) * 7 % max(2, lm.vocab_size - 1) + 1  # [n] int64
    times = []
    for r in range(3):
        lm.rollback(0)
        start = time.perf_counter()
        lm.forward(ids, last_n=n)
        if r:
            times.append(time.perf_counter() - start)
    lm.rollback(0)
    return min(times)


def _cache_path(gguf: Path) -> Path:
    """Per CPU, llama.cpp library and GGUF file (threads: this machine's default)."""
    from specdecode.costs import costs_dir, cpu_name
    from specdecode.models.llama_cpp import use_cached_build

    path = Path(gguf)
    key = "|".join(["prefill-copy-v2", cpu_name(), use_cached_build() or "wheel", path.name,
                    str(path.stat().st_size)])
    return costs_dir() / ("prefill-copy-" + hashlib.sha256(key.encode()).hexdigest()[:20]
                          + ".json")
