"""A `CausalLM` over llama.cpp (llama-cpp-python's low-level ctypes API): fast GGUF on CPU.

One `LlamaCppLM` owns one llama.cpp model and one context (KV cache); it is
sequence 0, and `sequence(i)` opens more (own sequence ids in the same context);
a draft model is a second instance with its own context. The GGUF's own
quantised weights are used as they are (nothing is dequantised).

- forward: one `llama_decode` batch per up to `n_batch` new tokens, at
  positions cached_len.., with outputs requested only for the last `last_n`
  positions; their logits are copied out as a float32 torch tensor.
- rollback: `llama_memory_seq_rm(mem, seq, length, -1)` forgets positions >= length.
- hidden_layers: FINAL_LAYER only, the final hidden state after the output norm
  (llama.cpp's "embeddings" of a generative model), switched on in the context for
  the calls that ask for it (then llama.cpp outputs every position of the batch);
  other layers are a ValueError (llama.cpp exposes no intermediate layers).
- positions + tree_mask (a tree pass): each leaf's root path gets a branch sequence
  id, a node carries the ids of the leaves below it, and each branch first shares
  the sequence's cells (`llama_memory_seq_cp`), so llama.cpp's own mask (same id,
  position <= own) is the tree mask (a tree's rows equal its chains' bit for bit here).
  `keep(path)` drops the branch ids (seq_rm) and decodes the path again as a chain
  after the prefix: one more pass of len(path) tokens. (Adding the sequence's id to
  the path's cells instead, seq_cp from a branch, gave wrong logits, 0.76-0.91 off
  on SmolLM2, whenever a dropped node's cell lay before a kept one, with and without
  flash attention; the cause is not found yet.)
- Contexts: one sequence id (as before) until a second sequence or a tree pass is
  asked for; then the context is rebuilt once with MAX_SEQ_IDS ids and one unified
  KV cache of max_seq_len cells per open sequence, the caches moved over byte for
  byte (`llama_state_seq_get_data` / `set_data`).

Exactness: llama.cpp computes a k-token batch with other kernels than a
1-token step (and quantises activations), so batched logits can differ from
one-token logits in the last bits; greedy output can then differ from plain
decoding at a near-tie. llama.cpp's stderr logging is silenced unless
SPECDECODE_DEBUG is set. Needs `specdecode build-llama-cpp` (the library and bindings).

Libraries: when `specdecode build-llama-cpp` has built llama.cpp for this CPU
into the cache (AVX-512 without AMX, see llama_cpp_build.py), those are loaded
instead of the wheel's (LLAMA_CPP_LIB_PATH, unless already set).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specdecode import limits, threads
from specdecode.models import hugepages, llama_cpp_prefill
from specdecode.models.base import (
    FINAL_LAYER,
    CacheSnapshot,
    ForwardOutput,
    check_keep,
    wanted_layers,
)

MAX_SEQUENCES = 8  # sequence handles: ids 0..7
MAX_SEQ_IDS = 64  # in a multi-sequence context; ids 8..63 are a tree pass's branches

_backend_ready = False
_log_callback = None  # the ctypes callback must outlive every llama.cpp call


def use_cached_build() -> str | None:
    """Before llama-cpp-python is first imported: point it at the cached build for
    this CPU if there is one of the installed version. Returns the library folder
    in use (None: the wheel's own)."""
    import sys
    from importlib import metadata

    from specdecode.models import llama_cpp_build

    if "llama_cpp" not in sys.modules and "LLAMA_CPP_LIB_PATH" not in os.environ:
        folder = llama_cpp_build.build_dir()
        try:
            installed = metadata.version("llama_cpp_python")
        except metadata.PackageNotFoundError:
            installed = None
        if installed == llama_cpp_build.VERSION and llama_cpp_build.is_built(folder):
            os.environ["LLAMA_CPP_LIB_PATH"] = str(folder / "lib")
    return os.environ.get("LLAMA_CPP_LIB_PATH")


def available() -> bool:
    """Whether llama-cpp-python can be imported here."""
    use_cached_build()
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # ImportError, or a shared library that fails to load
        return False
    return True


def _lib():
    """The low-level bindings, initialised once (backend, quiet logging)."""
    global _backend_ready, _log_callback
    use_cached_build()
    from llama_cpp import llama_cpp as lib

    if not _backend_ready:
        if not os.environ.get("SPECDECODE_DEBUG"):
            _log_callback = lib.llama_log_callback(lambda level, text, data: None)
            lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lib.llama_backend_init()
        _backend_ready = True
    return lib


def default_threads() -> int:
    """CPUs this process may run on (threads.py decides what llama.cpp uses)."""
    return threads.cpus()


class LlamaCppLM:
    """A GGUF model run by llama.cpp on CPU: rollback-able sequence 0, more by `sequence(i)`."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_seq_len: int | None = None,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_batch: int = 512,
        flash_attn: bool | None = None,
        extra_bufts: bool | None = None,
        mmap: bool = False,
        huge_pages: bool | None = None,
        prefill_copy: bool | None = False,
    ) -> None:
        """path: a GGUF file. max_seq_len: context size in tokens (default: the
        model's training context, at most 8192; more than that context, or a KV
        cache the memory cannot hold, is a ValueError before it is allocated).
        n_threads: threads for 1-token steps, n_threads_batch: for batches
        (default: all CPUs available).
        n_batch: most tokens per llama_decode call (longer inputs are split).
        flash_attn: True/False, or None: $SPECDECODE_FLASH_ATTN (on / off / auto),
        else llama.cpp's automatic choice (on, for CPUs). Off was faster on a
        2-core Xeon: at 1.8k tokens of context a 49-token verification takes 947 ms
        without it and 1267 with it (b=17: 432 vs 551; one-token steps equal;
        llama-bench pp49 @ d1800: 58 vs 41 t/s); but then even 2-token batches
        differ from one-token steps in the last bits (SmolLM2 Q4_1: greedy
        speculative output left plain decoding's at k=1), so exactness keeps it on.
        extra_bufts: let llama.cpp repack weights into its extra CPU layouts
        (repacked Q4_0/Q4_K/IQ4_NL, AMX). None: on unless the library was built
        with AMX kernels (a wheel compiled on an AMX machine), whose matmul crashed
        in a VM here; turning them off also loses the repacked layouts (1.2x slower
        decoding, 2x slower than the cached build: `specdecode build-llama-cpp`).
        mmap: map the GGUF file (llama.cpp's default) instead of reading it into
        memory; mapped pages cannot become huge pages.
        huge_pages: back the weights and the KV cache with 2 MiB pages
        (hugepages.py; with 4 KiB pages the one-token step of the same model ran
        1.1-1.3x slower or not, depending on where its pages landed; 2 MiB pages
        were as fast as the best case every time). None: on unless
        SPECDECODE_HUGE_PAGES=0. Costs 2-5 s of load time for the default
        pair; `huge_page_bytes` says how much memory it backed.
        prefill_copy: run long passes (prompts, long verifications) on a second,
        memory-mapped copy of the weights in llama.cpp's plain layout
        (llama_cpp_prefill.py); True: from 96 new tokens on; None: from the length
        measured to pay on this machine (llama_cpp_prefill.decide), if any."""
        self._lib = _lib()
        self._model = self._ctx = self._batch = None
        # Torch's threads are the loader's business (threads.py: one thread beside a
        # llama.cpp-only process); this constructor sets no process-wide state.
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        self._load_weights(path, extra_bufts, mmap, huge_pages)
        self._read_model_facts(path, max_seq_len)
        self.n_threads = n_threads or threads.llama_threads()
        self.n_threads_batch = n_threads_batch or self.n_threads
        self.n_batch = min(n_batch, self.max_seq_len)
        if flash_attn is None:
            flash_attn = {"on": True, "off": False}.get(
                os.environ.get("SPECDECODE_FLASH_ATTN", "auto").lower())
        self.flash_attn = flash_attn
        self._seq0 = _Seq(0)
        self._handles: dict[int, LlamaCppSequence] = {}
        self._free_branch_ids: list[int] = []  # tree-branch sequence ids not in use
        self._make_context(self.max_seq_len, 1)
        self.path = path
        self._prefill_copy = None  # _forward reads it while open_copy measures
        self._prefill_copy = llama_cpp_prefill.open_copy(self, prefill_copy)

    def _load_weights(self, path: Path, extra_bufts: bool | None, mmap: bool,
                      huge_pages: bool | None) -> None:
        """Load the GGUF's weights (see __init__ for the options)."""
        lib = self._lib
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        if extra_bufts is None:
            extra_bufts = b"AMX_INT8 = 1" not in lib.llama_print_system_info()
        mparams.use_extra_bufts = self.extra_bufts = extra_bufts
        self.mmap = mmap
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP if mmap else lib.LLAMA_LOAD_MODE_NONE
        if huge_pages is None:
            huge_pages = os.environ.get("SPECDECODE_HUGE_PAGES", "1") != "0"
        self.huge_pages = huge_pages  # asked for; huge_page_bytes: what the kernel gave
        with hugepages.collapse_new_memory(huge_pages) as weights:
            self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path} (set SPECDECODE_DEBUG=1 "
                               "to see its log)")
        self._weight_huge_pages = weights[0]

    def _read_model_facts(self, path: Path, max_seq_len: int | None) -> None:
        """Vocabulary, sizes, EOS and the checked context length (and its KV memory)."""
        lib = self._lib
        vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size: int = lib.llama_vocab_n_tokens(vocab)
        self.hidden_size: int = lib.llama_model_n_embd(self._model)
        eos = lib.llama_vocab_eos(vocab)
        self.eos_token_ids: tuple[int, ...] = () if eos < 0 else (int(eos),)
        trained = lib.llama_model_n_ctx_train(self._model)
        if max_seq_len is None:
            max_seq_len = min(trained, 8192)
        self.max_seq_len: int = limits.check_context(max_seq_len, trained, path.name)
        limits.check_memory(self._kv_cache_bytes(max_seq_len),
                            f"the KV cache of {max_seq_len} tokens")

    def _make_context(self, n_ctx: int, n_seq_max: int) -> None:
        """A context of n_ctx cells for n_seq_max sequence ids (one unified KV cache when
        more than one, so a tree's tokens can belong to several branches) and a batch of
        n_batch tokens with up to n_seq_max ids each. Frees the old ones."""
        lib = self._lib
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = n_seq_max
        if n_seq_max > 1:
            cparams.kv_unified = True
        cparams.n_threads, cparams.n_threads_batch = self.n_threads, self.n_threads_batch
        cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_AUTO if self.flash_attn is None
                                   else int(bool(self.flash_attn)))  # DISABLED 0, ENABLED 1
        cparams.no_perf = True
        self._free_context()
        with hugepages.collapse_new_memory(self.huge_pages) as cache:
            self._ctx = lib.llama_init_from_model(self._model, cparams)
        self.huge_page_bytes: int = self._weight_huge_pages + cache[0]
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._memory = lib.llama_get_memory(self._ctx)
        self._embeddings = False
        self._n_ctx, self._n_seq_max = n_ctx, n_seq_max
        self._batch = lib.llama_batch_init(self.n_batch, 0, n_seq_max)
        b, n = self._batch, self.n_batch
        self._tokens = np.ctypeslib.as_array(b.token, shape=(n,))  # views of the batch
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._want = np.ctypeslib.as_array(b.logits, shape=(n,))
        self._slot_seqs: list[tuple[int, ...]] = [()] * n  # the ids each batch slot holds

    def _free_context(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
        if self._ctx:
            self._lib.llama_free(self._ctx)
        self._batch = self._ctx = None

    def _kv_cache_bytes(self, n_ctx: int) -> int:
        """Bytes of llama.cpp's f16 KV cache for n_ctx tokens (before it is allocated)."""
        lib, m = self._lib, self._model
        head_dim = lib.llama_model_n_embd(m) // max(1, lib.llama_model_n_head(m))
        return (2 * lib.llama_model_n_layer(m) * lib.llama_model_n_head_kv(m) * head_dim
                * n_ctx * limits.LLAMA_CPP_KV_BYTES)

    def _regrow(self, n_ctx: int) -> None:
        """A multi-sequence context of n_ctx cells; each sequence's cache is moved over
        (llama_state_seq_get/set_data: the same f16 keys/values, byte for byte)."""
        seqs = [self._seq0, *(h._seq for h in self._handles.values())]
        if any(q.tree is not None for q in seqs):
            raise ValueError("keep or roll back the pending tree pass before opening a sequence")
        saved = [(q, *self._read_cells(q)) for q in seqs if q.length]
        self._make_context(n_ctx, MAX_SEQ_IDS)
        self._free_branch_ids = list(range(MAX_SEQUENCES, MAX_SEQ_IDS))
        for q, buf, size in saved:
            if not self._write_cells(q, buf, size):
                raise RuntimeError(f"llama.cpp could not restore sequence {q.seq_id}")

    # -- CausalLM -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # of the logits; the weights keep the GGUF's quantisation

    @property
    def cached_len(self) -> int:
        return self._seq0.length

    @property
    def cached_ids(self) -> list[int]:
        """The token ids in the cache, in position order (read only); up to a tree pass
        not yet kept or rolled back."""
        return self._seq0.reusable_ids

    def rollback(self, length: int) -> None:
        self._rollback(self._seq0, length)

    def snapshot(self) -> CacheSnapshot:
        """A copy of sequence 0's cache (prefix_store.py)."""
        return self._snapshot(self._seq0)

    def restore(self, snap: CacheSnapshot) -> None:
        """Put a snapshot of this model's caches back in sequence 0 (prefix_store.py)."""
        self._restore(self._seq0, snap)

    def keep(self, indices: Sequence[int], *, start: int | None = None) -> None:
        """See CausalLM.keep. After a tree pass (positions + tree_mask): `start` is the
        tree's (cached_len before it) and indices a path from a root (depths 0, 1, ..);
        the branches are dropped and the path decoded again as a chain. Without
        one: only a contiguous run from start (a rollback; llama.cpp would have to
        shift the positions of anything else)."""
        self._keep(self._seq0, indices, start)

    def prefill(self, ids: torch.Tensor, *, hidden_layers: Sequence[int] = ()
                ) -> ForwardOutput:  # ids: [T] int64
        self.rollback(0)
        return self.forward(ids, last_n=1, hidden_layers=hidden_layers)

    def forward(
        self,
        ids: torch.Tensor,  # [T] int64
        *,
        last_n: int | None = None,
        hidden_layers: Sequence[int] = (),
        return_hidden: bool = False,
        positions: torch.Tensor | None = None,  # [T] int64; with tree_mask only
        tree_mask: torch.Tensor | None = None,  # [T, T] bool; with positions only
    ) -> ForwardOutput:
        """See CausalLM.forward. hidden_layers: FINAL_LAYER only (llama_get_embeddings).
        A tree (positions = cached_len + depth, tree_mask = ancestors and self, parents
        before children) runs as one sequence id per leaf; keep or rollback must follow."""
        embeddings = self._final_only(wanted_layers(hidden_layers, return_hidden,
                                                    self.n_layers))
        return self._forward(self._seq0, ids, last_n, embeddings, positions, tree_mask)

    def sequence(self, index: int) -> LlamaCppLM | LlamaCppSequence:
        """Sequence `index` (0: this model; at most MAX_SEQUENCES). Opening a new one
        rebuilds the context as one unified KV cache of max_seq_len cells per open
        sequence (memory checked first: the f16 cache of max_seq_len tokens each) and
        moves the open sequences' caches into it."""
        if index == 0:
            return self
        if not 0 < index < MAX_SEQUENCES:
            raise ValueError(f"sequence index {index} must be in 0..{MAX_SEQUENCES - 1}")
        if index not in self._handles:
            limits.check_memory(self._kv_cache_bytes(self.max_seq_len),
                                f"the KV cache of sequence {index}")
            self._regrow(self.max_seq_len * (2 + len(self._handles)))
            self._handles[index] = LlamaCppSequence(self, _Seq(index))
        return self._handles[index]

    def forward_many(
        self, items: Sequence[tuple[LlamaCppLM | LlamaCppSequence, torch.Tensor]],
        *, last_n: int | None = None, hidden_layers: Sequence[int] = (),
    ) -> list[ForwardOutput]:  # items: (handle, ids [T_i] int64)
        """See CausalLM.forward_many: one llama_batch (split at n_batch) whose tokens carry
        their sequence's id."""
        seqs = [self._seq_of(h) for h, _ in items]
        if len({q.seq_id for q in seqs}) != len(seqs):
            raise ValueError("forward_many: each sequence may appear once")
        embeddings = self._final_only(wanted_layers(hidden_layers, False, self.n_layers))
        layout = [self._chain(q, ids, last_n) for q, (_, ids) in zip(seqs, items)]
        tokens, pos, want = (np.concatenate([part[i] for part in layout]) for i in range(3))
        sid = [(q.seq_id,) for q, (_, ids) in zip(seqs, items) for _ in range(len(ids))]
        logits, hidden = self._decode_or_undo(seqs, tokens, pos, sid, want, embeddings)
        for q, (_, ids) in zip(seqs, items):
            q.grow(ids.tolist())
        sizes = [int(part[2].sum()) for part in layout]
        return [ForwardOutput(lg, hidden_states={FINAL_LAYER: h} if h is not None else {})
                for lg, h in zip(logits.split(sizes), hidden.split(sizes) if embeddings
                                 else [None] * len(sizes))]

    # -- one sequence's operations (the model's and its handles') ---------------

    @property
    def n_layers(self) -> int:
        return self._lib.llama_model_n_layer(self._model)

    def _final_only(self, layers: tuple[int, ...]) -> bool:
        """Whether the final hidden state is asked for; other layers are a ValueError."""
        others = [i for i in layers if i != FINAL_LAYER]
        if others:
            raise ValueError(f"the llama.cpp backend returns only the final hidden state "
                             f"(hidden_layers=(FINAL_LAYER,) = ({FINAL_LAYER},), what "
                             f"llama_get_embeddings gives), not layers {others}; the torch "
                             "backend returns any layer")
        return bool(layers)

    def _seq_of(self, handle: object) -> _Seq:
        if handle is self:
            return self._seq0
        if isinstance(handle, LlamaCppSequence) and handle.model is self:
            return handle._seq
        raise ValueError("forward_many: every handle must be a sequence of this model")

    def _snapshot(self, seq: _Seq) -> CacheSnapshot:
        """A copy of a sequence's cells (llama_state_seq_get_data: its f16 keys/values)."""
        if seq.tree is not None:
            raise ValueError("keep or roll back the pending tree pass before a snapshot")
        if not seq.length:
            return CacheSnapshot([], np.empty(0, dtype=np.uint8), 0)
        buf, size = self._read_cells(seq)
        return CacheSnapshot(list(seq.ids), buf[:size], size)

    def _restore(self, seq: _Seq, snap: CacheSnapshot) -> None:
        """Replace a sequence's cells by a snapshot of this model's (byte for byte)."""
        self._rollback(seq, 0)
        if snap.ids and not self._write_cells(seq, snap.data, snap.nbytes):
            raise RuntimeError(f"llama.cpp could not restore sequence {seq.seq_id}")
        seq.length, seq.ids = len(snap.ids), list(snap.ids)

    def _read_cells(self, seq: _Seq, buffer: np.ndarray | None = None,  # [n] uint8
                    ) -> tuple[np.ndarray, int]:
        """A sequence's cells as llama_state_seq_get_data writes them (its f16 keys
        and values): into `buffer` when it has room, else into a new unzeroed array;
        returns (the array, bytes written). RuntimeError if llama.cpp writes nothing
        or more than the room it asked for."""
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, seq.seq_id))
        if buffer is None or buffer.size < size:
            buffer = np.empty(size, dtype=np.uint8)
        written = int(lib.llama_state_seq_get_data(self._ctx, _bytes_at(buffer), size,
                                                   seq.seq_id))
        if not 0 < written <= size:
            raise RuntimeError(f"llama.cpp could not read sequence {seq.seq_id}")
        return buffer, written

    def _write_cells(self, seq: _Seq, buffer: np.ndarray,  # [>= nbytes] uint8
                     nbytes: int) -> bool:
        """Replace a sequence's cells by `nbytes` that _read_cells wrote (a model of
        the same GGUF); False if llama.cpp took fewer (the sequence is then unusable:
        roll it back to 0)."""
        return self._lib.llama_state_seq_set_data(
            self._ctx, _bytes_at(buffer), nbytes, seq.seq_id) == nbytes

    def _rollback(self, seq: _Seq, length: int) -> None:
        if seq.tree is not None:
            if length > seq.tree.start:
                raise ValueError(f"cannot roll back to {length} inside a tree pass: keep() "
                                 f"its accepted path or roll back to <= {seq.tree.start}")
            self._drop_tree(seq)
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {seq.length} tokens")
        # (always: cells a failed decode left past the length go too, so reused ids
        # never sit beside stray cells)
        if not self._lib.llama_memory_seq_rm(self._memory, seq.seq_id, length, -1):
            raise RuntimeError(f"llama.cpp could not roll its cache back to {length} tokens")
        seq.length = length
        del seq.ids[length:]

    def _chain(self, seq: _Seq, ids: torch.Tensor, last_n: int | None):  # ids: [T] int64
        """tokens, positions [T] int32 and outputs wanted [T] int8 of a chain pass."""
        t, start = int(ids.shape[0]), seq.length
        if seq.tree is not None:
            raise ValueError("keep or roll back the pending tree pass first")
        if start + t > self.max_seq_len:
            raise ValueError(f"{start + t} tokens exceed the context limit of {self.max_seq_len}")
        n = t if last_n is None else last_n
        if not 0 <= n <= t:
            raise ValueError(f"last_n={last_n} must be in 0..{t}")
        want = np.zeros(t, dtype=np.int8)
        want[t - n:] = 1
        return (ids.detach().cpu().numpy().astype(np.int32),
                np.arange(start, start + t, dtype=np.int32), want)

    def _forward(self, seq: _Seq, ids: torch.Tensor,  # ids: [T] int64
                 last_n: int | None, embeddings: bool,
                 positions: torch.Tensor | None,  # [T] int64
                 tree_mask: torch.Tensor | None,  # [T, T] bool
                 ) -> ForwardOutput:
        if (positions is None) != (tree_mask is None):
            raise NotImplementedError("the llama.cpp backend takes positions only with a "
                                      "tree_mask (a tree pass), and a tree_mask only with them")
        tokens, pos, want = self._chain(seq, ids, last_n)
        if (tree_mask is None and self._prefill_copy is not None
                and self._prefill_copy.pays(seq.length, len(tokens))):
            return self._prefill_copy.run(self, seq, ids, last_n, embeddings)
        sid: list[tuple[int, ...]] = [(seq.seq_id,)] * len(tokens)
        tree = None
        if tree_mask is not None:
            tree = self._plan_tree(seq, positions, tree_mask, tokens)
            pos, sid = tree.positions, tree.seqs
            for b in tree.branches:  # every branch sees the sequence's cells
                self._lib.llama_memory_seq_cp(self._memory, seq.seq_id, b, -1, -1)
            seq.tree = tree
        logits, hidden = self._decode_or_undo([seq], tokens, pos, sid, want, embeddings)
        seq.grow(tokens.tolist())
        return ForwardOutput(logits, hidden_states={FINAL_LAYER: hidden} if embeddings else {})

    def _plan_tree(self, seq: _Seq, positions: torch.Tensor,  # [T] int64
                   tree_mask: torch.Tensor,  # [T, T] bool
                   tokens: np.ndarray,  # [T] int32
                   ) -> _Tree:
        """One branch sequence id per leaf; a node belongs to the branches of the leaves
        below it, so llama.cpp's mask (same id, position <=) is exactly the tree's."""
        mask = tree_mask.detach().cpu().bool()
        t, start = mask.shape[0], seq.length
        depth = mask.sum(1) - 1
        if (not torch.equal(mask, mask.tril()) or not bool(mask.diagonal().all())
                or not torch.equal(positions.cpu().long(), start + depth)):
            raise ValueError("tree_mask must mark each node's ancestors and itself, parents "
                             "before children, and positions must be cached_len + depth")
        leaves = [i for i in range(t) if int(mask[:, i].sum()) == 1]
        if self._n_seq_max == 1:
            self._regrow(self._n_ctx)
        if len(leaves) > len(self._free_branch_ids):
            raise ValueError(f"a tree of {len(leaves)} leaves: at most "
                             f"{len(self._free_branch_ids)} free branch ids")
        branches = [self._free_branch_ids.pop() for _ in leaves]
        seqs = [tuple(b for b, leaf in zip(branches, leaves) if mask[leaf, i]) for i in range(t)]
        shared = torch.tensor([[bool(set(a) & set(b)) for b in seqs] for a in seqs])
        if not torch.equal(shared & (depth[None, :] <= depth[:, None]), mask):
            self._free_branch_ids.extend(branches)
            raise ValueError("tree_mask is not a tree: a node's ancestors must be a chain")
        return _Tree(start, branches, seqs, depth.tolist(),
                     positions.cpu().numpy().astype(np.int32), tokens)

    def _drop_tree(self, seq: _Seq) -> None:
        """Forget the branch ids of the pending tree (cells only they held are freed)."""
        for b in seq.tree.branches:
            self._lib.llama_memory_seq_rm(self._memory, b, -1, -1)
        self._free_branch_ids.extend(seq.tree.branches)
        seq.tree = None

    def _keep(self, seq: _Seq, indices: Sequence[int], start: int | None) -> None:
        start = check_keep(indices, start, seq.length)
        idx, tree = [int(i) for i in indices], seq.tree
        if tree is None:
            if idx != list(range(start, start + len(idx))):
                raise ValueError("keep without a tree pass: only a contiguous run from start "
                                 "(the kept tokens must have run at their final positions)")
            self._rollback(seq, start + len(idx))
            return
        nodes = [i - tree.start for i in idx]
        if start != tree.start or [tree.depth[n] for n in nodes] != list(range(len(nodes))) \
                or any(not set(tree.seqs[b]) <= set(tree.seqs[a])
                       for a, b in zip(nodes, nodes[1:])):
            raise ValueError(f"keep after a tree pass: start must be {tree.start} and indices "
                             "a path from a root (depths 0, 1, ...)")
        self._drop_tree(seq)
        self._rollback(seq, tree.start)
        if nodes:  # the path again, as a chain (see the module docstring)
            self._forward(seq, torch.from_numpy(tree.tokens[nodes]).long(), 0, False, None,
                          None)

    # -- decoding -------------------------------------------------------------------

    def _decode_or_undo(self, seqs: list[_Seq], tokens, pos, sid, want, embeddings: bool):
        """_decode; on failure each sequence forgets this call's tokens (and its tree)."""
        try:
            return self._decode(tokens, pos, sid, want, embeddings)
        except RuntimeError:
            for q in seqs:
                if q.tree is not None:
                    self._drop_tree(q)
                self._lib.llama_memory_seq_rm(self._memory, q.seq_id, q.length, -1)
            raise

    def _decode(
        self,
        tokens: np.ndarray,  # [N] int32
        pos: np.ndarray,  # [N] int32
        sid: list[tuple[int, ...]],  # [N] the sequence ids of each token
        want: np.ndarray,  # [N] int8: 1 = logits wanted
        embeddings: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [wanted, vocab], [wanted, hidden]
        """llama_decode per up to n_batch tokens; the wanted rows' logits (and hidden)."""
        lib, logits, hidden = self._lib, [], []
        if embeddings != self._embeddings:  # on, llama.cpp outputs every position
            lib.llama_set_embeddings(self._ctx, embeddings)
            self._embeddings = embeddings
        for c0 in range(0, len(tokens), self.n_batch):
            m = min(self.n_batch, len(tokens) - c0)
            self._fill(tokens[c0:c0 + m], pos[c0:c0 + m], sid[c0:c0 + m], want[c0:c0 + m])
            rc = lib.llama_decode(self._ctx, self._batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with status {rc} at position "
                                   f"{int(pos[c0])}")
            chunk = want[c0:c0 + m].astype(bool)
            outputs = int(chunk.sum())
            if outputs:
                rows = m if embeddings else outputs  # rows llama.cpp wrote
                logits.append(self._read(lib.llama_get_logits(self._ctx), rows, chunk,
                                         self.vocab_size, embeddings))
                if embeddings:
                    hidden.append(self._read(lib.llama_get_embeddings(self._ctx), rows, chunk,
                                             self.hidden_size, True))
        return (_join(logits, self.vocab_size),
                _join(hidden, self.hidden_size) if embeddings else None)

    def _fill(self, tokens, pos, sid: list[tuple[int, ...]], want) -> None:  # [m] each
        """Put m tokens into the batch (sequence ids rewritten only where they change)."""
        b, m = self._batch, len(tokens)
        self._tokens[:m], self._pos[:m], self._want[:m] = tokens, pos, want
        for i, ids in enumerate(sid):
            if self._slot_seqs[i] != ids:
                b.n_seq_id[i] = len(ids)
                for j, s in enumerate(ids):
                    b.seq_id[i][j] = s
                self._slot_seqs[i] = ids
        b.n_tokens = m

    @staticmethod
    def _read(ptr, rows: int, chunk: np.ndarray, cols: int, all_rows: bool
              ) -> torch.Tensor:  # -> [wanted, cols] float32
        """A copy of the wanted rows of the rows x cols floats at ptr (all_rows: llama.cpp
        wrote every token's row; else only the wanted ones, in order)."""
        out = np.ctypeslib.as_array(ptr, shape=(rows, cols))
        return torch.from_numpy(out[chunk] if all_rows else out.copy())

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Free the context, batch and model (also done when garbage-collected)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        self._free_context()
        if getattr(self, "_prefill_copy", None) is not None:
            self._prefill_copy.close()
            self._prefill_copy = None
        if self._model:
            lib.llama_model_free(self._model)
        self._lib = self._batch = self._ctx = self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at shutdown the library may be gone already
            self.close()

    def __repr__(self) -> str:
        return (f"LlamaCppLM({self.path.name}, ctx={self.max_seq_len}, "
                f"threads={self.n_threads}/{self.n_threads_batch}, flash_attn={self.flash_attn}"
                f", mmap={self.mmap}, huge_pages={self.huge_pages}"
                f"{'' if self.extra_bufts else ', no repacked weights'}"
                f"{self._copy_note()})")

    def _copy_note(self) -> str:
        copy = getattr(self, "_prefill_copy", None)
        return "" if copy is None else f", plain-layout copy from {copy.min_new} tokens"


@dataclass
class _Tree:
    """A tree pass not yet kept or rolled back: its start (the sequence's length before
    it), the branch ids it took, and per node its ids, depth and position."""

    start: int
    branches: list[int]
    seqs: list[tuple[int, ...]]
    depth: list[int]
    positions: np.ndarray  # [T] int32
    tokens: np.ndarray  # [T] int32


@dataclass
class _Seq:
    """One sequence's state in the shared context: its id, length, the token ids at
    its positions (what a new request can reuse) and its pending tree."""

    seq_id: int
    length: int = 0
    tree: _Tree | None = None
    ids: list[int] = field(default_factory=list)

    @property
    def reusable_ids(self) -> list[int]:
        """ids up to a pending tree pass (whose tokens are not a chain at their indices)."""
        return self.ids if self.tree is None else self.ids[:self.tree.start]

    def grow(self, ids: list[int]) -> None:
        """Count tokens a decode has just put at length.. ."""
        self.length += len(ids)
        self.ids += ids


class LlamaCppSequence:
    """A handle on one more sequence of a LlamaCppLM (see LlamaCppLM.sequence): the
    CausalLM methods of the model itself, on its own sequence id."""

    def __init__(self, model: LlamaCppLM, seq: _Seq) -> None:
        self.model, self._seq = model, seq
        self.vocab_size, self.max_seq_len = model.vocab_size, model.max_seq_len
        self.eos_token_ids, self.hidden_size = model.eos_token_ids, model.hidden_size

    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)
    cached_len = property(lambda self: self._seq.length)
    cached_ids = property(lambda self: self._seq.reusable_ids)

    def rollback(self, length: int) -> None:
        self.model._rollback(self._seq, length)

    def snapshot(self) -> CacheSnapshot:
        return self.model._snapshot(self._seq)

    def restore(self, snap: CacheSnapshot) -> None:
        self.model._restore(self._seq, snap)

    def keep(self, indices: Sequence[int], *, start: int | None = None) -> None:
        self.model._keep(self._seq, indices, start)

    def prefill(self, ids: torch.Tensor, *, hidden_layers: Sequence[int] = ()
                ) -> ForwardOutput:  # ids: [T] int64
        self.rollback(0)
        return self.forward(ids, last_n=1, hidden_layers=hidden_layers)

    def forward(self, ids: torch.Tensor, *, last_n: int | None = None,  # ids: [T] int64
                hidden_layers: Sequence[int] = (), return_hidden: bool = False,
                positions: torch.Tensor | None = None,  # [T] int64
                tree_mask: torch.Tensor | None = None,  # [T, T] bool
                ) -> ForwardOutput:
        m = self.model
        embeddings = m._final_only(wanted_layers(hidden_layers, return_hidden, m.n_layers))
        return m._forward(self._seq, ids, last_n, embeddings, positions, tree_mask)

    def sequence(self, index: int) -> LlamaCppLM | LlamaCppSequence:
        return self.model.sequence(index)

    def forward_many(
        self, items: Sequence[tuple[LlamaCppLM | LlamaCppSequence, torch.Tensor]],
        *, last_n: int | None = None, hidden_layers: Sequence[int] = (),
    ) -> list[ForwardOutput]:  # items: (handle, ids [T_i] int64)
        return self.model.forward_many(items, last_n=last_n, hidden_layers=hidden_layers)


def _join(parts: list[torch.Tensor], cols: int) -> torch.Tensor:  # -> [sum rows, cols]
    """Rows of the chunks in order (one chunk, the usual case, without a copy)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, cols)


def _bytes_at(buffer: np.ndarray):  # buffer: [n] uint8 -> uint8 *
    """A ctypes pointer to a numpy byte array's first element (for llama_state_seq_*)."""
    return buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
