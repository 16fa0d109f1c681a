"""Size limits checked before anything large is allocated.

A context (KV cache) size or a draft length that the model or the machine
cannot hold must fail with a ValueError that names the setting, not get the
process killed by the kernel. The checks here are pure arithmetic over a
model's config plus one look at the memory this process may still use
(/proc/meminfo's MemAvailable, capped by a cgroup limit; psutil elsewhere):

- a context may not exceed the model's trained context (`max_position_embeddings`,
  GGUF `context_length`);
- a step feeds the pending token plus k draft tokens after at least one prompt
  token, so k <= context - 2;
- weights + KV caches + activations must fit in the memory available
  (memory.py adds up the parts of a whole load from the arithmetic here).

`check_load` runs the first two for `LLM.load` before any weights are read,
memory.py's plan the third; the model classes call `check_context` /
`check_memory` where they allocate.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.options import OptionError

if TYPE_CHECKING:
    from specdecode.models.config import ModelConfig

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2}
LLAMA_CPP_KV_BYTES = 2  # llama.cpp's default KV cache type is f16


def _positive_int(value: object, name: str) -> int:
    """value if it is an integer >= 1, else OptionError about option `name`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(f"<{name}> must be an integer >= 1, got {value!r}")
    return value


def check_context(max_seq_len: object, trained: int, model: str = "the model") -> int:
    """max_seq_len if it is an integer in 1..trained, else OptionError (options.py)."""
    size = _positive_int(max_seq_len, "max_seq_len")
    if size > trained:
        raise OptionError(f"<max_seq_len> {size} exceeds the trained context of {model}: "
                          f"{trained} tokens")
    return size


def check_k(k: object, context: int) -> None:
    """k draft tokens per step must leave room for a prompt token and the pending one."""
    if k is None:
        return
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise OptionError(f"<k> must be an integer >= 0, got {k!r}")
    if k > context - 2:
        raise OptionError(f"<k> {k} does not fit a context of {context} tokens: at most "
                          f"{max(0, context - 2)}")


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, elem_bytes: int) -> int:
    """Keys + values of every layer for seq_len tokens."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * seq_len * elem_bytes


def rope_bytes(cfg: ModelConfig, seq_len: int, elem_bytes: int) -> int:
    """The Transformer's cos/sin tables plus their float64 temporaries at build time."""
    return seq_len * cfg.head_dim * (20 + 2 * elem_bytes)


def weight_bytes(cfg: ModelConfig, elem_bytes: int) -> int:
    """Parameters of the decoder (tied embeddings counted once) times elem_bytes."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    if cfg.qkv_bias:
        attn += d * (cfg.num_heads + 2 * cfg.num_kv_heads)
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return (cfg.num_layers * layer + embed + h) * elem_bytes


def available_bytes() -> int | None:
    """Memory this process may still allocate (None: unknown, then nothing is checked)."""
    avail = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is None:
        with contextlib.suppress(Exception):
            import psutil

            avail = int(psutil.virtual_memory().available)
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        avail = cgroup if avail is None else min(avail, cgroup)
    return avail


def _cgroup_headroom() -> int | None:
    """cgroup v2 memory.max - memory.current of this process's cgroup, if limited."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        group = Path("/proc/self/cgroup").read_text().split("\n")[0].split(":", 2)[2]
        folder = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit != "max":
            return int(limit) - int((folder / "memory.current").read_text())
    return None


def check_memory(need: int, what: str, device: str = "cpu") -> None:
    """ValueError if `need` bytes (described by `what`) exceed the memory left on device."""
    if str(device).startswith("cuda"):
        avail = cuda_free(device)
    elif str(device) == "meta":
        return
    else:
        avail = available_bytes()
    if avail is not None and need > avail:
        raise OptionError(f"{what} needs about {need / GB:.1f} GB, but only "
                          f"{avail / GB:.1f} GB of memory is available on {device}; lower "
                          "<max_seq_len>")


def cuda_free(device: str) -> int | None:
    import torch

    with contextlib.suppress(Exception):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return None


def model_config(path: Path) -> ModelConfig | None:
    """The config of a GGUF file or HF folder, read from metadata only (None: unreadable,
    the loader then reports why)."""
    from specdecode.models import loading

    with contextlib.suppress(Exception):
        return loading.read_config(path)
    return None


def check_load(target: str, *, k: int | None, max_seq_len: int | None, dtype: str,
               device: str, backend: str | None) -> None:
    """The size checks for `LLM.load` before any weights are read: the context
    against the target's trained context, k against the context (memory:
    memory.MemoryPlan.check). dtype, device, backend: accepted for the callers'
    convenience, unused. Raises ValueError."""
    from specdecode.models import registry

    if max_seq_len is not None:
        _positive_int(max_seq_len, "max_seq_len")
    path = registry.resolve(target)
    cfg = model_config(path)
    if cfg is None:
        if max_seq_len is not None:
            check_k(k, max_seq_len)
        return
    context = (min(cfg.max_position_embeddings, 8192) if max_seq_len is None
               else check_context(max_seq_len, cfg.max_position_embeddings, path.name))
    check_k(k, context)
