"""Small files under $SPECDECODE_CACHE written whole or not at all."""

from __future__ import annotations

import contextlib
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
