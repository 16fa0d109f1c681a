"""Real checkpoints -> the native Transformer: GGUF files and HF safetensors folders.

GGUF tensors are dequantized with the `gguf` package (any type it knows:
Q4_K, Q5_0, Q6_K, Q8_0, Q4_1, F16, F32, ...). The first load of a GGUF stores
the converted weights (safetensors, in the chosen dtype), the config and the
tokenizer under $SPECDECODE_CACHE/converted/; later loads read those instead
of dequantizing again.

Hugging Face folders: config.json + model.safetensors (or sharded with
model.safetensors.index.json) + tokenizer files. Architectures: llama
(SmolLM2, Llama, Mistral without sliding window) and qwen2.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specdecode import limits
from specdecode.models import gguf_meta, wide_f32
from specdecode.models.arena import move_to_arena
from specdecode.models.config import ModelConfig
from specdecode.models.registry import cache_dir
from specdecode.models.transformer import Transformer
from specdecode.text import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")
CONVERTED_FORMAT = 1  # bump when the converted layout changes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class UnsupportedModel(ValueError):
    """The checkpoint's architecture or layout is not one this loader handles."""


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Tokenizer
    source: Path
    load_seconds: float
    from_cache: bool  # GGUF only: the converted weights were already cached


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose one of float32, bfloat16, float16")
    return DTYPES[name]


def load(
    path: str | Path,
    *,
    dtype: str | torch.dtype = torch.bfloat16,
    device: str = "cpu",
    max_seq_len: int | None = None,
) -> Loaded:
    """Load a GGUF file or an HF folder as a Transformer plus its tokenizer.

    max_seq_len: the KV cache size (default: the trained context, at most 8192);
    more than the trained context, or a cache the memory cannot hold, is a
    ValueError before anything is allocated (limits.py)."""
    start, path, dtype = time.perf_counter(), Path(path), parse_dtype(dtype)
    if path.is_dir():
        cfg, state, tokenizer, cached = *_load_hf_folder(path, dtype), False
    elif path.suffix == ".gguf" and path.is_file():
        cfg, state, tokenizer, cached = _load_gguf_cached(path, dtype)
    elif path.exists():
        raise UnsupportedModel(f"{path} is neither a .gguf file nor a Hugging Face folder")
    else:
        raise FileNotFoundError(f"no such model file or folder: {path}")
    if max_seq_len is None:
        max_seq_len = min(cfg.max_position_embeddings, 8192)
    limits.check_context(max_seq_len, cfg.max_position_embeddings, path.name)
    model = build(cfg, state, dtype=dtype, device=device, max_seq_len=max_seq_len)
    return Loaded(model, tokenizer, path, time.perf_counter() - start, cached)


def build(
    cfg: ModelConfig, state: dict[str, torch.Tensor], *, dtype: torch.dtype, device: str,
    max_seq_len: int,
) -> Transformer:
    """A Transformer with the given weights (on CPU copied into a huge-page arena; bf16 on
    a CPU without bf16 matrix hardware multiplies wide passes in float32: wide_f32.py)."""
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len=max_seq_len, dtype=dtype, device="meta")
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise UnsupportedModel(
            f"weights do not fit the {cfg.arch} layout: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if torch.device(device).type == "cpu":
        move_to_arena(model)  # out of the file mapping: ~1.4x faster decoding, see arena.py
    if wide_f32.wanted(device, dtype):
        wide_f32.install(model)  # wide passes in float32 (no bf16 matrix hardware)
    model._allocate_cache()
    return model.eval()


# -- GGUF ---------------------------------------------------------------------

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_name_to_ours(name: str) -> str:
    """'blk.3.attn_q.bias' -> 'layers.3.self_attn.q_proj.bias', etc."""
    top = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, layer, part, kind = name.split(".")
    if part not in _GGUF_NAMES:
        raise UnsupportedModel(f"unexpected GGUF tensor '{name}'")
    return f"layers.{layer}.{_GGUF_NAMES[part]}.{kind}"


def gguf_config(reader) -> ModelConfig:
    """ModelConfig from GGUF metadata; an unsupported architecture is an error naming it."""
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModel(f"unsupported architecture '{arch}' (supported: "
                               f"{', '.join(SUPPORTED_ARCHS)})")
    names = {t.name for t in reader.tensors}
    n_heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    eos = field("tokenizer.ggml.eos_token_id")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // n_heads)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        eos_token_ids=() if eos is None else (int(eos),),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        arch=arch,
    )


def dequantize_tensor(tensor) -> np.ndarray:  # -> [rows, cols] float32, torch layout
    """One GGUF tensor as float32 in PyTorch's [out, in] layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.array(tensor.data, dtype=np.float32)  # a copy: the reader maps read-only
    else:
        data = dequantize(tensor.data, tensor.tensor_type)
    return data.reshape([int(d) for d in reversed(tensor.shape)])


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores llama q/k rows interleaved for its RoPE; undo it (HF layout)."""
    rest = w.shape[1:]
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(w.shape))


def open_gguf(path: Path):
    """A GGUFReader over a complete GGUF file; a truncated or corrupt one is an
    UnsupportedModel naming the file, not a raw numpy error."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UnsupportedModel(f"{path} is not a valid GGUF file (truncated or corrupt: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__})"
                               ) from None
    size = path.stat().st_size
    if end > size:
        raise UnsupportedModel(f"{path} is truncated: its tensors need {end} bytes, the file "
                               f"has {size}")
    return reader


def gguf_tensors(path: str | Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Those of the named tensors a GGUF file has, dequantized: name -> [rows, cols]
    float16 (one read of the file's index)."""
    tensors = {t.name: t for t in open_gguf(Path(path)).tensors}
    return {n: torch.from_numpy(dequantize_tensor(tensors[n])).half()
            for n in names if n in tensors}


def read_config(path: str | Path) -> ModelConfig:
    """A model's config from metadata only (GGUF header, converted cache or config.json)."""
    path = Path(path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.exists():
            raise UnsupportedModel(f"{path} has no config.json (not a Hugging Face model folder)")
        return hf_config(json.loads(config_file.read_text()))
    return gguf_meta.cached_config(path, lambda p: gguf_config(open_gguf(p)))


def read_gguf(path: Path, dtype: torch.dtype, progress: bool = True):
    """Dequantize a whole GGUF file -> (config, state dict in `dtype`)."""
    from rich.progress import track

    reader = open_gguf(path)
    cfg = gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    tensors = track(reader.tensors, description=f"convert {path.name}", disable=not progress,
                    transient=True)
    for tensor in tensors:
        name = gguf_name_to_ours(tensor.name)
        w = torch.from_numpy(dequantize_tensor(tensor))
        if cfg.arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rope(w, cfg.num_heads)
        elif cfg.arch in ("llama", "mistral") and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rope(w, cfg.num_kv_heads)
        state[name] = w.to(dtype).contiguous()
    return cfg, state


def _converted_dir(path: Path, dtype: torch.dtype) -> Path:
    stat = path.stat()
    key = f"{path.stem}-{stat.st_size}-{str(dtype).removeprefix('torch.')}-v{CONVERTED_FORMAT}"
    return cache_dir() / "converted" / key


def _load_gguf_cached(path: Path, dtype: torch.dtype):
    folder = _converted_dir(path, dtype)
    done = folder / "DONE"
    # Our config is not an HF config.json: transformers would read it when loading
    # the tokenizer from this folder (and warn about a Mistral regex).
    config_file = folder / "specdecode_config.json"
    if done.exists() and (folder / "config.json").exists() and not config_file.exists():
        (folder / "config.json").rename(config_file)  # caches written before the rename
    if done.exists():
        cfg = gguf_meta.config_from_dict(json.loads(config_file.read_text()))
        state = load_file(folder / "model.safetensors")
        return cfg, state, Tokenizer.from_folder(folder), True
    cfg, state = read_gguf(path, dtype)
    tokenizer = Tokenizer.from_gguf(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    config_file.write_text(json.dumps(asdict(cfg), indent=1))
    tokenizer.save(folder)
    done.write_text("ok\n")
    return cfg, state, tokenizer, False


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A model's tokenizer alone, without touching its weights (for the llama.cpp backend).

    HF folder: its tokenizer files. GGUF: the tokenizer saved with any converted
    cache of that file, else read from the GGUF metadata once and cached under
    $SPECDECODE_CACHE/converted/<name>-tokenizer-v<format>/."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_folder(path)
    stem = f"{path.stem}-{path.stat().st_size}"
    own = cache_dir() / "converted" / f"{stem}-tokenizer-v{CONVERTED_FORMAT}"
    converted = sorted((cache_dir() / "converted").glob(f"{stem}-*-v{CONVERTED_FORMAT}"))
    for folder in (own, *converted):
        # A cache written before the config rename holds our config.json: not a tokenizer's.
        if (folder / "DONE").exists() and not (folder / "config.json").exists():
            return Tokenizer.from_folder(folder)
    tokenizer = Tokenizer.from_gguf(path)
    own.mkdir(parents=True, exist_ok=True)
    tokenizer.save(own)
    (own / "DONE").write_text("ok\n")
    return tokenizer


# -- Hugging Face folders ---------------------------------------------------------

def hf_config(raw: dict) -> ModelConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModel(f"unsupported architecture '{arch}' (supported: "
                               f"{', '.join(SUPPORTED_ARCHS)})")
    n_heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=raw.get("num_key_value_heads", n_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        arch=arch,
    )


def _load_hf_folder(folder: Path, dtype: torch.dtype):
    config_file = folder / "config.json"
    if not config_file.exists():
        raise UnsupportedModel(f"{folder} has no config.json (not a Hugging Face model folder)")
    cfg = hf_config(json.loads(config_file.read_text()))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise UnsupportedModel(f"{folder} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(folder / name).items():
            state[key.removeprefix("model.")] = tensor
    return cfg, state, Tokenizer.from_folder(folder)
