"""A GGUF file's ModelConfig, parsed from its header once per version of the file.

gguf's reader builds every metadata field, the tokenizer's ~150k-entry string
arrays included: 6-17 s for one file on a 2-core Zen 3, where llama.cpp loads
the whole model in a few. The memory checks, the planner and the loader each
ask for the config, so a load used to parse the target's header three times.
Here a parsed config is kept in this process and in $SPECDECODE_CACHE/configs/
(one small JSON file per file version), so only the first load of a file pays.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from specdecode.models.config import ModelConfig
from specdecode.models.registry import cache_dir

FORMAT = 1  # bump when gguf_config reads a field it did not read before

_parsed: dict[str, ModelConfig] = {}


def file_key(path: Path) -> str:
    """A key for this version of the file: its resolved path, size and change time
    (a file replaced or truncated gets a new key)."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{FORMAT}"


def _cache_file(key: str) -> Path:
    return cache_dir() / "configs" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def config_from_dict(fields: dict) -> ModelConfig:
    """A ModelConfig from `dataclasses.asdict` of one, read back from JSON."""
    return ModelConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})


def _read_saved(key: str) -> ModelConfig | None:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(_cache_file(key).read_text())
        if saved["key"] == key:
            return config_from_dict(saved["config"])
    return None


def _save(key: str, cfg: ModelConfig) -> None:
    """Written whole or not at all (a temporary file renamed); a read-only cache
    only costs the next process a parse."""
    target = _cache_file(key)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "config": asdict(cfg)}, indent=1))
        tmp.replace(target)


def cached_config(path: Path, parse: Callable[[Path], ModelConfig]) -> ModelConfig:
    """`parse(path)`, or what it returned for this version of the file before (in
    this process or an earlier one). A parse that raises is not remembered."""
    key = file_key(path)
    cfg = _parsed.get(key) or _read_saved(key)
    if cfg is None:
        cfg = parse(path)
        _save(key, cfg)
    _parsed[key] = cfg
    return cfg
