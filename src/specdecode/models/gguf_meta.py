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
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from specdecode.cachefile import read_keyed, write_keyed
from specdecode.models.config import ModelConfig
from specdecode.models.registry import cache_dir

FORMAT = 1  # bump whenever gguf_config's result for a given file may change

_parsed: dict[str, ModelConfig] = {}


def file_key(path: Path) -> str:
    """A key for this version of the file: its resolved path, inode, size and
    modification and change times (a file replaced, copied over or truncated gets a
    new key; copy tools can set the modification time, not the change time)."""
    stat = path.stat()
    return (f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|"
            f"{stat.st_ctime_ns}|v{FORMAT}")


def _folder() -> Path:
    """Where parsed configs are kept: $SPECDECODE_CACHE/configs."""
    return cache_dir() / "configs"


def config_from_dict(fields: dict) -> ModelConfig:
    """A ModelConfig from `dataclasses.asdict` of one, read back from JSON."""
    return ModelConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})


def _read_saved(key: str) -> ModelConfig | None:
    """The config kept for `key`, or None (none kept, unreadable, or another format)."""
    saved = read_keyed(_folder(), key)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return None if saved is None else config_from_dict(saved["config"])
    return None


def cached_config(path: Path, parse: Callable[[Path], ModelConfig]) -> ModelConfig:
    """`parse(path)`, or what it returned for this version of the file before (in
    this process or an earlier one). A parse that raises is not remembered."""
    key = file_key(path)
    cfg = _parsed.get(key) or _read_saved(key)
    if cfg is None:
        cfg = parse(path)
        write_keyed(_folder(), key, {"config": asdict(cfg)})  # best effort
    _parsed[key] = cfg
    return cfg
