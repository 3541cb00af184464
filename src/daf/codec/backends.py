"""The implementations of the format-1 kernels, and the choice between them.

A backend is anything with ``encode_flat`` and ``decode_flat`` of the reference's
signatures. The reference is always there; the native CPU kernels are offered
when ``daf.kernels`` built them. ``DAF_BACKEND=reference|native`` in the
environment overrides ``Config.backend``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Protocol

import torch

from daf.codec import reference

__all__ = ["Backend", "select_backend", "BACKEND_ENV"]

BACKEND_ENV = "DAF_BACKEND"


class Backend(Protocol):
    name: str

    def encode_flat(self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...

    def decode_flat(self, payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor: ...


class _ReferenceBackend:
    name = "reference"
    encode_flat = staticmethod(reference.encode_flat)
    decode_flat = staticmethod(reference.decode_flat)


REFERENCE: Backend = _ReferenceBackend()


def _native() -> Backend | None:
    try:
        from daf.kernels import native_backend
    except ImportError:
        return None
    return native_backend()


def select_backend(requested: str = "auto") -> Backend:
    """The backend for ``Config.backend`` (``"auto"``, ``"native"``, ``"reference"``).

    ``"native"`` raises ``RuntimeError`` with the build's reason when the kernels are
    unavailable; ``"auto"`` falls back to the reference (the build already warned once).
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in ("native", "reference", "auto"):
            raise ValueError(f"{BACKEND_ENV} must be 'native', 'reference' or 'auto', got {forced!r}")
        requested = forced
    if requested == "reference":
        return REFERENCE
    native = _native()
    if native is not None:
        return native
    if requested == "native":
        from daf.kernels import native_status
        raise RuntimeError(f"backend='native' was asked for but the native kernels are unavailable: {native_status()}")
    return REFERENCE
