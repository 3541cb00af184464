"""Loading the kernels: status, one warning on a failed build, backend selection."""

import warnings

import pytest
import torch

import daf
from daf.codec.backends import select_backend
from daf.kernels import build, native_backend, native_status


def test_status_says_loaded(extension):
    assert native_status().startswith("loaded (")
    assert native_backend().name == "native"
    assert native_backend() is not native_backend()  # one object (and autotuner) per caller


def test_failed_build_warns_once_and_reports_why(monkeypatch):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nlong log")

    monkeypatch.setattr(cpp_extension, "load", broken)
    uncached = build.load_extension.__wrapped__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = uncached()
    assert result.module is None and result.status == "not loaded: RuntimeError: no compiler here"
    assert len(caught) == 1 and "using the reference codec" in str(caught[0].message)


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
        daf.wrap(model, bits=2, min_numel=1, backend=backend)
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
