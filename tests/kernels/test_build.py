"""Loading the kernels: status, one warning on a failed build, backend selection."""

import importlib.util
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import daf
from daf.codec.backends import select_backend
from daf.kernels import build, native_backend, native_status


def test_status_says_loaded(extension):
    assert native_status().startswith("loaded (")
    assert native_backend().name == "native"
    assert native_backend() is not native_backend()  # one object (and autotuner) per caller


# What torch raises when the compiler fails: the failed command first, the compiler's own error further down.
_TORCH_BUILD_ERROR = ("Error building extension 'daf_kernels_avx2': [1/2] c++ -MMD -MF bindings.o.d -O3 -fopenmp ...\n"
                      "FAILED: bindings.o\nc++ -MMD -MF bindings.o.d ...\n"
                      "/src/daf/kernels/csrc/bindings.cpp:7:10: fatal error: pybind11/pybind11.h: No such file\n"
                      "compilation terminated.\nninja: build stopped: subcommand failed.")


def _load_here(monkeypatch, tmp_path):
    """``load_extension`` uncached, ignoring kernels built at install, with an empty extension cache."""
    monkeypatch.setenv(build.PREBUILT_ENV, "0")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build.load_extension.__wrapped__()
    return result, [str(w.message) for w in caught if "DAF native kernels" in str(w.message)]


def test_failed_build_says_it_was_building_then_the_compiler_error(monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError(_TORCH_BUILD_ERROR)

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setenv("CXX", sys.executable)  # a program that exists: the build itself fails
    result, warned = _load_here(monkeypatch, tmp_path)
    cause = "RuntimeError: /src/daf/kernels/csrc/bindings.cpp:7:10: fatal error: pybind11/pybind11.h: No such file"
    assert result.module is None and result.status == f"not loaded: {cause}"
    assert warned == [f"DAF native kernels unavailable, using the reference codec ({cause})"]
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and notice[0].startswith("DAF: building the native kernels for this CPU (")
    assert "about 30 s, once (DAF_PREBUILT_KERNELS=0)" in notice[0]


def test_a_missing_compiler_is_named_without_running_a_build(monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    def must_not_run(*args, **kwargs):
        raise AssertionError("built without a compiler")

    monkeypatch.setattr(cpp_extension, "load", must_not_run)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no c++
    monkeypatch.delenv("CXX", raising=False)
    result, warned = _load_here(monkeypatch, tmp_path)
    assert result.status == "not loaded: c++ not found on PATH: install a C++ compiler (apt-get install g++) or set CXX"
    assert len(warned) == 1 and "c++ not found on PATH" in warned[0]
    assert "building" not in capsys.readouterr().err


def test_kernels_built_for_other_sources_are_not_used(monkeypatch):
    stale = types.SimpleNamespace(build_key=lambda: "k0000000000000000")
    monkeypatch.setattr(build.importlib, "import_module", lambda name: stale)
    monkeypatch.delenv(build.PREBUILT_ENV, raising=False)
    module, why = build._prebuilt("avx2")
    assert module is None and why == "the avx2 kernels built at install are for other sources or another torch"


def test_the_loaded_kernels_carry_the_build_key_of_these_sources(extension):
    isa = build.isa_name(torch.backends.cpu.get_cpu_capability())
    assert extension.build_key() == build.build_key(isa)


_INSTALLED = build.isa_name(torch.backends.cpu.get_cpu_capability())


@pytest.mark.skipif(importlib.util.find_spec(f"daf.kernels._native_{_INSTALLED}") is None,
                    reason="no kernels were built at install (pip install --no-build-isolation; scripts/setup.sh)")
def test_kernels_built_at_install_load_without_a_compiler_or_a_cache(tmp_path):
    cache = tmp_path / "extensions"
    cache.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("CXX", build.PREBUILT_ENV)}
    env.update(PATH=str(tmp_path), TORCH_EXTENSIONS_DIR=str(cache), PYTHONPATH=str(Path(daf.__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", "import daf; print(daf.native_status())"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"loaded ({_INSTALLED}") and "built at install" in done.stdout, done.stdout
    assert list(cache.iterdir()) == [] and "building" not in done.stderr


def test_simd_flags_follow_the_cpu_capability():
    assert "-DCPU_CAPABILITY_AVX512" in build.simd_flags("AVX512")
    assert build.simd_flags("DEFAULT") == ()


def test_environment_applies_only_where_the_config_says_auto(monkeypatch, extension):
    monkeypatch.setenv("DAF_BACKEND", "reference")
    chosen = select_backend("auto")
    assert chosen.name == "reference" and "DAF_BACKEND='reference'" in chosen.reason
    assert select_backend("native").name == "native"  # an explicit setting wins over the environment
    monkeypatch.setenv("DAF_BACKEND", "native")
    assert select_backend("reference").name == "reference"
    chosen = select_backend("auto")
    assert chosen.name == "native" and "DAF_BACKEND='native'" in chosen.reason
    assert chosen.serial_twin().reason == chosen.reason
    monkeypatch.delenv("DAF_BACKEND")
    chosen = select_backend("auto")
    assert chosen.name == "native" and "DAF_BACKEND" not in chosen.reason and "Config.backend='auto'" in chosen.reason


def test_bad_backend_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend("fast")
    monkeypatch.setenv("DAF_BACKEND", "fast")
    with pytest.raises(ValueError, match="DAF_BACKEND must be one of"):
        select_backend("auto")
    assert select_backend("reference").name == "reference"  # not consulted for an explicit setting


def test_training_with_native_and_reference_backends_gives_identical_gradients(extension):
    # Byte-identical payloads mean identical decoded activations, hence identical gradients.
    grads = {}
    for backend in ("native", "reference"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
        daf.wrap(model, bits=2, min_numel=1, backend=backend, codec=daf.MinMax())
        model(torch.randn(300, 64)).square().sum().backward()
        assert daf.report(model).sections["codec"]["codec"] == f"minmax/{backend}"
        grads[backend] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["native"], grads["reference"]))


def test_without_kernels_auto_takes_the_reference_and_native_raises(monkeypatch):
    import daf.kernels

    monkeypatch.setattr(daf.kernels, "native_backend", lambda reason="": None)
    monkeypatch.setattr(daf.kernels, "native_status", lambda: "not loaded: RuntimeError: no compiler here")
    monkeypatch.delenv("DAF_BACKEND", raising=False)
    chosen = select_backend("auto")
    assert chosen.name == "reference" and "no compiler here" in chosen.reason
    with pytest.raises(RuntimeError, match="no compiler here"):
        select_backend("native")


@pytest.mark.parametrize("chosen", [False, True])
def test_the_cache_checked_is_the_folder_torch_builds_in(monkeypatch, tmp_path, chosen):
    """A cached build is found where torch puts it (with TORCH_EXTENSIONS_DIR, and in torch's default root's
    per-interpreter folder), so a process that only reloads it does not say it is building."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "default"))
    if chosen:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    folder = Path(cpp_extension._get_build_directory("daf_kernels_probe", False))
    assert folder.parent == build.extension_root()
    assert build._will_compile("daf_kernels_probe")
    (folder / "daf_kernels_probe.so").write_bytes(b"")
    assert not build._will_compile("daf_kernels_probe")
