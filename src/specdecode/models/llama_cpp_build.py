"""Build llama.cpp (shared libraries + llama-server + llama-bench) into the cache.

`specdecode build-llama-cpp` is the one build of the llama.cpp backend: it
compiles the llama.cpp sources vendored in the pinned llama-cpp-python sdist
into $SPECDECODE_CACHE/llama.cpp/<version>-<isa>/ (lib/, bin/), then installs
llama-cpp-python's Python bindings from the same sdist without building their
own copy of the library (CMAKE_ARGS=-DLLAMA_BUILD=OFF: about 10 s). The
backend points the bindings at the cached libraries (LLAMA_CPP_LIB_PATH, see
llama_cpp.use_cached_build), and the llama.cpp benchmark runs its llama-server.
About 9 minutes on 2 cores (AMD EPYC, AVX2); instant when already built.

Why not llama-cpp-python's own build (-DGGML_NATIVE=ON): on CPUs with AMX
(Sapphire Rapids and later) it enables ggml's AMX kernels, whose first matmul
crashed (SIGSEGV at `ldtilecfg`, even with the AMX permission requested) in
this project's VMs; the backend then has to turn off every repacked weight
layout and decodes 2x slower. This build enables AVX-512 (VNNI, BF16, VBMI)
and AVX-VNNI where the CPU has them, and never AMX.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"  # the llama-cpp-python release whose sources and bindings are used


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines
                 if line.startswith("flags")), set())


def cmake_options(flags: set[str]) -> tuple[str, list[str]]:
    """(ISA tag for the folder name, -D options) for a CPU with these flags."""
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
            "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"]
    isa = "avx2"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        opts.append("-DGGML_AVX512=ON")
        isa = "avx512"
        for flag, opt, tag in (("avx512_vnni", "AVX512_VNNI", "-vnni"),
                               ("avx512_bf16", "AVX512_BF16", "-bf16"),
                               ("avx512vbmi", "AVX512_VBMI", "")):
            if flag in flags:
                opts.append(f"-DGGML_{opt}=ON")
                isa += tag
    if "avx_vnni" in flags:
        opts.append("-DGGML_AVX_VNNI=ON")
    return isa, opts


REQUIRED = ("avx", "avx2", "fma", "f16c", "bmi2")  # what cmake_options turns on for any CPU


def missing_features(flags: set[str], machine: str | None = None) -> list[str]:
    """The instruction-set features this build needs that an x86-64 CPU with these
    flags lacks (empty: it can run the build; other architectures and unreadable
    flags are not checked)."""
    import platform

    machine = platform.machine() if machine is None else machine
    if machine.lower() not in ("x86_64", "amd64") or not flags:
        return []
    return [f for f in REQUIRED if f not in flags]


def build_root() -> Path:
    from specdecode.models.registry import cache_dir

    return cache_dir() / "llama.cpp"


def build_dir(flags: set[str] | None = None) -> Path:
    """Where the build for this CPU lives (whether or not it is built)."""
    isa, _ = cmake_options(cpu_flags() if flags is None else flags)
    return build_root() / f"{VERSION}-{isa}"


def is_built(folder: Path) -> bool:
    return (folder / "lib" / "libllama.so").is_file() and (
        folder / "bin" / "llama-server").is_file()


def installed_bindings() -> str | None:
    """The installed llama-cpp-python version, or None."""
    from importlib import metadata

    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None


def install_bindings(src: Path) -> None:
    """pip-install llama-cpp-python's Python package from the sdist at `src` without
    its library (the cached build provides it), unless VERSION is installed."""
    if installed_bindings() == VERSION:
        return
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", str(src)],
                          env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"installing the llama-cpp-python bindings failed (exit "
                           f"{proc.returncode})")


def build(jobs: int | None = None, bindings: bool = True) -> Path:
    """Build (or find) llama.cpp for this CPU, and (bindings) install the Python
    bindings that use it; returns the build's folder. Raises RuntimeError naming
    the step that failed."""
    missing = missing_features(cpu_flags())
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing).upper()}, which the llama.cpp "
                           "build needs; use the torch backend (--backend torch)")
    out = build_dir()
    src = _sources()
    if not is_built(out):
        _compile(src, out, jobs)
    if bindings:
        install_bindings(src)
    return out


def _sources() -> Path:
    """The unpacked llama-cpp-python sdist (downloaded once)."""
    src_root = build_root() / "src"
    src = src_root / f"llama_cpp_python-{VERSION}"
    if not src.is_dir():
        src_root.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
              ":all:", f"llama-cpp-python=={VERSION}", "-d", str(src_root)], "download the sdist")
        with tarfile.open(src_root / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            tar.extractall(src_root, filter="data")
    return src


def _compile(src: Path, out: Path, jobs: int | None) -> None:
    """Configure and compile the vendored llama.cpp into `out` (lib/, bin/)."""
    _, opts = cmake_options(cpu_flags())
    work = out / "build"
    _run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(work),
          "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
          "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
          "-DLLAMA_OPENSSL=OFF", *opts], "configure (cmake)")
    _run(["cmake", "--build", str(work), "-j", str(jobs or os.cpu_count() or 1),
          "--target", "llama-server", "llama-bench"], "compile")
    (out / "bin").mkdir(exist_ok=True)
    (out / "lib").mkdir(exist_ok=True)
    for tool in ("llama-server", "llama-bench"):
        shutil.copy2(work / "bin" / tool, out / "bin" / tool)
    for lib in work.rglob("lib*.so*"):
        target = out / "lib" / lib.name
        if lib.is_symlink():
            target.unlink(missing_ok=True)
            target.symlink_to(os.readlink(lib))
        else:
            shutil.copy2(lib, target)


def _run(cmd: list[str], step: str) -> None:
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"building llama.cpp failed at: {step} (exit {proc.returncode})")
