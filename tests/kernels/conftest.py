"""Fixtures of the native-kernel tests: the backend, with its autotune cache in a temporary directory."""

import pytest

from daf.kernels import native_status
from daf.kernels.autotune import Autotuner
from daf.kernels.build import load_extension


@pytest.fixture(scope="session")
def extension():
    """The loaded kernels (built on first use, then from torch's extension cache)."""
    module = load_extension().module
    if module is None:
        pytest.skip(f"native kernels unavailable: {native_status()}")
    return module


@pytest.fixture
def native(extension, tmp_path):
    from daf.kernels.backend import NativeBackend

    return NativeBackend(Autotuner(tmp_path / "autotune.json", repeats=1))
