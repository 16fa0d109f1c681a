"""A `CausalLM` over llama.cpp (llama-cpp-python's low-level ctypes API): fast GGUF on CPU.

One `LlamaCppLM` owns one llama.cpp model and one context (KV cache, sequence 0);
a draft model is a second instance with its own context. The GGUF's own
quantised weights are used as they are (nothing is dequantised).

- forward: one `llama_decode` batch per up to `n_batch` new tokens, at
  positions cached_len.., with outputs requested only for the last `last_n`
  positions; their logits are copied out as a float32 torch tensor.
- rollback: `llama_memory_seq_rm(mem, 0, length, -1)` forgets positions >= length.
- return_hidden: the final hidden state after the output norm (llama.cpp's
  "embeddings" of a generative model), switched on in the context for the
  calls that ask for it (then llama.cpp outputs every position of the batch).
- positions / tree_mask: not supported yet (chain verification only).

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
from pathlib import Path

import numpy as np
import torch

from specdecode import limits
from specdecode.models import hugepages
from specdecode.models.base import ForwardOutput

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
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class LlamaCppLM:
    """A GGUF model run by llama.cpp on CPU, with one rollback-able sequence (batch 1)."""

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
    ) -> None:
        """path: a GGUF file. max_seq_len: context size in tokens (default: the
        model's training context, at most 8192; more than that context, or a KV
        cache the memory cannot hold, is a ValueError before it is allocated).
        n_threads: threads for 1-token steps, n_threads_batch: for batches
        (default: all CPUs available).
        n_batch: most tokens per llama_decode call (longer inputs are split).
        flash_attn: True/False, or None: $SPECDECODE_FLASH_ATTN (on / off / auto),
        else llama.cpp's automatic choice (on, for CPUs). Off is faster on this
        CPU kind: at 1.8k tokens of context a 49-token verification takes 947 ms
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
        pair; `huge_page_bytes` says how much memory it backed."""
        lib = self._lib = _lib()
        self._model = self._ctx = self._batch = None
        # llama.cpp's OpenMP threads and torch's (argmax, softmax over its logits)
        # spin against each other on a small CPU: torch stays on one thread (13 %
        # faster plain decoding on 2 cores).
        torch.set_num_threads(1)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
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
        self.n_threads = n_threads or default_threads()
        self.n_threads_batch = n_threads_batch or self.n_threads
        self.n_batch = min(n_batch, max_seq_len)
        if flash_attn is None:
            flash_attn = {"on": True, "off": False}.get(
                os.environ.get("SPECDECODE_FLASH_ATTN", "auto").lower())
        self.flash_attn = flash_attn

        cparams = lib.llama_context_default_params()
        cparams.n_ctx = max_seq_len
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads, cparams.n_threads_batch = self.n_threads, self.n_threads_batch
        cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn is None else
                                   int(bool(flash_attn)))  # DISABLED = 0, ENABLED = 1
        cparams.no_perf = True
        with hugepages.collapse_new_memory(huge_pages) as cache:
            self._ctx = lib.llama_init_from_model(self._model, cparams)
        self.huge_page_bytes: int = weights[0] + cache[0]
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {max_seq_len} tokens")
        self._memory = lib.llama_get_memory(self._ctx)
        self._embeddings = False
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        b, n = self._batch, self.n_batch
        for i in range(n):
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
        self._tokens = np.ctypeslib.as_array(b.token, shape=(n,))  # views of the batch
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._want = np.ctypeslib.as_array(b.logits, shape=(n,))
        self._len = 0
        self.path = path

    def _kv_cache_bytes(self, n_ctx: int) -> int:
        """Bytes of llama.cpp's f16 KV cache for n_ctx tokens (before it is allocated)."""
        lib, m = self._lib, self._model
        head_dim = lib.llama_model_n_embd(m) // max(1, lib.llama_model_n_head(m))
        return (2 * lib.llama_model_n_layer(m) * lib.llama_model_n_head_kv(m) * head_dim
                * n_ctx * limits.LLAMA_CPP_KV_BYTES)

    # -- CausalLM -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # of the logits; the weights keep the GGUF's quantisation

    @property
    def cached_len(self) -> int:
        return self._len

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._len} tokens")
        if length < self._len and not self._lib.llama_memory_seq_rm(self._memory, 0, length, -1):
            raise RuntimeError(f"llama.cpp could not roll its cache back to {length} tokens")
        self._len = length

    def prefill(self, ids: torch.Tensor) -> ForwardOutput:  # ids: [T] int64
        self.rollback(0)
        return self.forward(ids, last_n=1)

    def forward(
        self,
        ids: torch.Tensor,  # [T] int64
        *,
        last_n: int | None = None,
        return_hidden: bool = False,
        positions: torch.Tensor | None = None,  # [T] int64; only the default is supported
        tree_mask: torch.Tensor | None = None,  # [T, T] bool; only the default is supported
    ) -> ForwardOutput:
        if positions is not None or tree_mask is not None:
            raise NotImplementedError("the llama.cpp backend verifies chains only: positions "
                                      "and tree_mask are not supported yet")
        lib, t, start = self._lib, int(ids.shape[0]), self._len
        if start + t > self.max_seq_len:
            raise ValueError(f"{start + t} tokens exceed the context limit of {self.max_seq_len}")
        n = t if last_n is None else last_n
        if not 0 <= n <= t:
            raise ValueError(f"last_n={last_n} must be in 0..{t}")
        if return_hidden != self._embeddings:  # on, llama.cpp outputs every position
            lib.llama_set_embeddings(self._ctx, return_hidden)
            self._embeddings = return_hidden
        tokens = ids.detach().cpu().numpy().astype(np.int32)
        logits, hidden = [], []
        for c0 in range(0, t, self.n_batch):
            m = min(self.n_batch, t - c0)
            self._tokens[:m] = tokens[c0:c0 + m]
            self._pos[:m] = np.arange(start + c0, start + c0 + m, dtype=np.int32)
            outputs = min(m, max(0, c0 + m - (t - n)))  # wanted: the chunk's last rows
            self._want[:m - outputs], self._want[m - outputs:m] = 0, 1
            self._batch.n_tokens = m
            rc = lib.llama_decode(self._ctx, self._batch)
            if rc != 0:
                lib.llama_memory_seq_rm(self._memory, 0, start + c0, -1)
                self._len = start + c0
                raise RuntimeError(f"llama_decode failed with status {rc} at position "
                                   f"{start + c0}")
            self._len = start + c0 + m
            if outputs:
                rows = m if return_hidden else outputs  # rows llama.cpp wrote
                logits.append(self._read(lib.llama_get_logits(self._ctx), rows, outputs,
                                         self.vocab_size))
                if return_hidden:
                    hidden.append(self._read(lib.llama_get_embeddings(self._ctx), rows,
                                             outputs, self.hidden_size))
        return ForwardOutput(_join(logits, self.vocab_size),
                             _join(hidden, self.hidden_size) if return_hidden else None)

    @staticmethod
    def _read(ptr, rows: int, last: int, cols: int) -> torch.Tensor:  # -> [last, cols] float32
        """A copy of the last `last` of the `rows` x `cols` floats at ptr."""
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(rows, cols))[rows - last:].copy())

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        """Free the context, batch and model (also done when garbage-collected)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
        if self._ctx:
            lib.llama_free(self._ctx)
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
                f"{'' if self.extra_bufts else ', no repacked weights'})")


def _join(parts: list[torch.Tensor], cols: int) -> torch.Tensor:  # -> [sum rows, cols]
    """Rows of the chunks in order (one chunk, the usual case, without a copy)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.empty(0, cols)
