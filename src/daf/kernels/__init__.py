"""The format-1 codec's kernels: ops under ``torch.ops.daf``, the reference beside the C++ kernels.

``daf.kernels.reference`` is the plain-PyTorch statement of the format, ``daf.kernels.ops``
the ops (reference by default, C++ on CPU once built), ``daf.kernels.build`` the build;
``daf.kernels.mask_ops`` and ``mask_reference`` the same for the 1-bit masks and nonzeros,
``daf.kernels.layout_ops`` for the channels-last copy of a restored activation, ``daf.kernels.reduce_ops``
for the column magnitudes the Outliers codec splits by, ``daf.kernels.channel_ops`` for its split and
join along axis "channel".
Nothing here imports ``daf.codec``: the codec sits on top.

>>> isinstance(native_status(), str)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from daf.kernels.build import load_extension

if TYPE_CHECKING:
    from daf.kernels.backend import NativeBackend

__all__ = ["native_backend", "native_status"]


def native_backend(reason: str = "asked for by name") -> NativeBackend | None:
    """A new ``NativeBackend`` (with its own autotuner) or None when the kernels did not build.

    ``reason``: why it is chosen, kept on the backend for reports.
    The first call in a process builds or loads the extension (a failure warns once).
    """
    if load_extension().module is None:
        return None
    from daf.kernels.backend import NativeBackend

    return NativeBackend(reason=reason)


def native_status() -> str:
    """Whether the native kernels loaded, and why not if they did not."""
    return load_extension().status
