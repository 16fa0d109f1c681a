"""Small files under $SPECDECODE_CACHE written whole or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str) -> bool:
    """Write `text` to `path` through a temporary file in the same folder renamed over
    it, so a reader (another process or thread) sees the old file or the new one,
    never a part. False where the cache cannot be written (read-only): the caller
    only loses the saving."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            return True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # left only where the rename failed
    return False


def keyed_file(folder: Path, key: str) -> Path:
    """The JSON file in `folder` that holds what was saved for `key` (its hash names it)."""
    return folder / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def read_keyed(folder: Path, key: str) -> dict | None:
    """What `write_keyed` saved for `key`, or None (nothing saved, unreadable, or a
    file of another key)."""
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(keyed_file(folder, key).read_text())
        if isinstance(saved, dict) and saved.get("key") == key:
            return saved
    return None


def write_keyed(folder: Path, key: str, fields: dict) -> bool:
    """Save `fields` (JSON-serialisable) with `key`, atomically; False where it cannot."""
    return write_atomic(keyed_file(folder, key), json.dumps({"key": key, **fields}, indent=1))
