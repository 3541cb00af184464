"""The implementations of the format-1 codec, and the choice between them.

A backend is anything with ``encode_flat`` and ``decode_flat`` of the reference's
signatures. The reference (``daf.kernels.reference``) is always there; the native
backend (``daf.kernels.backend.NativeBackend``) calls the ``torch.ops.daf`` ops, whose
CPU implementation is the C++ kernels once ``daf.kernels`` built them. What the kernels
do not take (exceptional values, float64, other devices, other group sizes) is the op
registration's business (``daf.kernels.ops``), not a backend's.

``Config.backend`` decides; ``DAF_BACKEND=reference|native|auto`` in the environment
applies only where the config says ``"auto"`` (an explicit setting is never overridden).
Each selected backend's ``reason`` says where the choice came from.

``daf.kernels`` is imported on first use, not with this module: importing ``daf`` builds
and loads nothing.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

__all__ = ["Backend", "REFERENCE", "ReferenceBackend", "select_backend", "BACKEND_ENV", "BACKENDS"]

BACKEND_ENV = "DAF_BACKEND"
BACKENDS = ("auto", "native", "reference")


class Backend(Protocol):
    name: str

    def encode_flat(self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...

    def decode_flat(self, payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor: ...

    def decode_into(self, payload: torch.Tensor, bits: int, group_size: int, out: torch.Tensor,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor: ...


class ReferenceBackend:
    """The plain-PyTorch reference, any device; ``reason`` says why it was chosen."""

    name = "reference"

    def __init__(self, reason: str = "the default") -> None:
        self.reason = reason

    def encode_flat(self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        from daf.kernels import reference  # on first use: see the module docstring
        return reference.encode_flat(x, bits, group_size, stochastic, seed)

    def decode_flat(self, payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
        from daf.kernels import reference
        return reference.decode_flat(payload, numel, bits, group_size, dtype, exc_index, exc_value)

    def decode_into(self, payload: torch.Tensor, bits: int, group_size: int, out: torch.Tensor,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
        """The values into ``out`` in its logical order, whatever its layout (``out``'s numel and dtype say what)."""
        values = self.decode_flat(payload, out.numel(), bits, group_size, out.dtype, exc_index, exc_value)
        return out.copy_(values.view(out.shape))


REFERENCE: Backend = ReferenceBackend()


def select_backend(requested: str = "auto") -> Backend:
    """The backend for ``Config.backend`` (``"auto"``, ``"native"``, ``"reference"``).

    ``"auto"`` takes ``DAF_BACKEND`` when it is set, else the native kernels when they build
    (the build warned once otherwise), else the reference. ``"native"`` raises
    ``RuntimeError`` with the build's reason when the kernels are unavailable.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    source = f"Config.backend={requested!r}"
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if requested == "auto" and forced:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {forced!r}")
        requested, source = forced, f"{BACKEND_ENV}={forced!r} (Config.backend='auto')"
    if requested == "reference":
        return ReferenceBackend(source)
    from daf.kernels import native_backend, native_status

    native = native_backend(reason=f"{source}; kernels {native_status()}")
    if native is not None:
        return native
    if requested == "native":
        raise RuntimeError(f"backend='native' was asked for ({source}) but the native kernels are unavailable: "
                           f"{native_status()}")
    return ReferenceBackend(f"{source}; native kernels {native_status()}")
