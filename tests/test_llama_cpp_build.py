"""The llama.cpp build recipe (no compiling here: the options and where it goes)."""

from __future__ import annotations

from specdecode.models import llama_cpp_build as build

SAPPHIRE_RAPIDS = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile",
                   "amx_int8", "amx_bf16"}


def test_avx512_cpu_gets_avx512_and_never_amx():
    isa, opts = build.cmake_options(SAPPHIRE_RAPIDS)
    assert isa == "avx512-vnni-bf16"
    assert "-DGGML_NATIVE=OFF" in opts and "-DGGML_AVX512=ON" in opts
    assert {"-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=ON",
            "-DGGML_AVX_VNNI=ON"} <= set(opts)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(opts)
    assert not any(o.startswith("-DGGML_AMX") and o.endswith("=ON") for o in opts)


def test_avx2_cpu_gets_no_avx512():
    isa, opts = build.cmake_options({"avx", "avx2", "fma", "f16c"})
    assert isa == "avx2" and not any("AVX512" in o for o in opts)


def test_build_folder_is_per_version_and_isa(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    folder = build.build_dir(SAPPHIRE_RAPIDS)
    assert folder == tmp_path / "llama.cpp" / f"{build.VERSION}-avx512-vnni-bf16"
    assert not build.is_built(folder)
    (folder / "lib").mkdir(parents=True)
    (folder / "bin").mkdir()
    (folder / "lib" / "libllama.so").write_bytes(b"")
    (folder / "bin" / "llama-server").write_bytes(b"")
    assert build.is_built(folder)


def test_version_is_the_one_the_cpu_extra_pins():
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"llama-cpp-python=={build.VERSION}"' in pyproject
