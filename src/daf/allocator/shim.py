"""Where DAF's allocator shim (``csrc/allocator.cpp``) comes from: built at install, else on first use.

``setup.py`` compiles it into the package as ``daf/allocator/_shim*.so`` next to the kernels (it loads this
file alone, so it imports nothing from DAF). At run time that library is used when its
``daf_allocator_build_key()`` matches ``build_key()``: the digest of the source, the flags and torch's
version. Otherwise ``torch.utils.cpp_extension.load`` builds it into torch's extension cache (a few seconds,
once), named after the key so that checkouts sharing the cache never rebuild each other's.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
from pathlib import Path

__all__ = ["SOURCE", "FLAGS", "build_key", "compile_flags", "installed_path"]

SOURCE = Path(__file__).with_name("csrc") / "allocator.cpp"
FLAGS = ("-O2",)


def build_key() -> str:
    """The key the shim must carry to be used: a C identifier. O(size of the source)."""
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((*FLAGS, torch.__version__)).encode())
    return "k" + digest.hexdigest()[:16]


def compile_flags() -> list[str]:
    """The shim's C++ flags, at install and on first use alike."""
    return [*FLAGS, f"-DDAF_BUILD_KEY={build_key()}"]


def installed_path() -> Path | None:
    """The shim built at install (``setup.py``), if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(f"_shim{suffix}")
        if path.exists():
            return path
    return None
