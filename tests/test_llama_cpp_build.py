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


def test_a_cpu_without_avx2_is_refused_in_one_line_before_anything_is_built(
        monkeypatch, tmp_path, capsys):
    from specdecode import cli

    assert build.missing_features({"sse4_2", "avx"}, "x86_64") == ["avx2", "fma", "f16c", "bmi2"]
    assert build.missing_features({"avx", "avx2", "fma", "f16c", "bmi2"}, "x86_64") == []
    assert build.missing_features({"asimd"}, "aarch64") == []  # not an x86 build
    assert build.missing_features(set(), "x86_64") == []  # flags unreadable: not judged
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse4_2", "avx"})
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(build, "_sources", lambda: (_ for _ in ()).throw(
        AssertionError("nothing may be downloaded")))
    assert cli.main(["build-llama-cpp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "AVX2, FMA, F16C, BMI2" in err[0] and "--backend torch" in err[0]


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


def test_no_requirement_builds_a_second_llama_cpp():
    """llama.cpp is built once, by `specdecode build-llama-cpp`; a pip requirement on
    llama-cpp-python would compile its own copy of the library a second time."""
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert "llama-cpp-python" not in pyproject and "llama_cpp_python" not in pyproject


def test_bindings_are_installed_without_their_library(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(build, "installed_bindings", lambda: None)
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, env, **kw: calls.append(
        (cmd, env["CMAKE_ARGS"])) or type("P", (), {"returncode": 0})())
    build.install_bindings(tmp_path)
    (cmd, cmake), = calls
    assert cmd[-1] == str(tmp_path) and "-DLLAMA_BUILD=OFF" in cmake
    monkeypatch.setattr(build, "installed_bindings", lambda: build.VERSION)
    build.install_bindings(tmp_path)
    assert len(calls) == 1  # already installed: nothing to do
