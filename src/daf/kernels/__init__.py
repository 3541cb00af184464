"""Native CPU kernels for the format-1 codec, built on first use; the reference is the fallback.

>>> isinstance(native_status(), str)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from daf.kernels.build import load_extension

if TYPE_CHECKING:
    from daf.kernels.backend import NativeBackend

__all__ = ["native_backend", "native_status"]


def native_backend() -> NativeBackend | None:
    """A new ``NativeBackend`` (with its own autotuner) or None when the kernels did not build.

    The first call in a process builds or loads the extension (a failure warns once).
    """
    extension = load_extension()
    if extension.module is None:
        return None
    from daf.kernels.backend import NativeBackend

    return NativeBackend(extension.module)


def native_status() -> str:
    """Whether the native kernels loaded, and why not if they did not."""
    return load_extension().status
