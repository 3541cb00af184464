"""Build (on first use) and load the native format-1 kernels.

``torch.utils.cpp_extension.load`` compiles ``csrc/bindings.cpp`` once per source/flag
version into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and reloads the cached library afterwards (about 0.01 s).
The SIMD flags follow ``torch.backends.cpu.get_cpu_capability()``: without the matching
``CPU_CAPABILITY`` defines ``at::vec::Vectorized`` silently falls back to its slow generic
version.
On success the kernels become the CPU implementation of the ``torch.ops.daf`` ops
(``register_native`` of ``daf.kernels.ops``, ``mask_ops``, ``layout_ops`` and ``reduce_ops``).
"""

from __future__ import annotations

import functools
import hashlib
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["Extension", "load_extension", "simd_flags"]

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp",)
HEADERS = ("columns.h", "format1.h", "codes.h", "codes_avx2.h", "codes_avx512.h", "kernels.h", "masks.h", "nonzeros.h", "transpose.h")

# -ffp-contract=off: the reference rounds a * b + c twice; a contracted FMA would round once.
BASE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
_ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
}


@dataclass(frozen=True)
class Extension:
    """The loaded library (or None) and a sentence saying what happened."""

    module: ModuleType | None
    status: str


def simd_flags(capability: str) -> tuple[str, ...]:
    """Compiler flags for torch's CPU capability name; () is the portable build (Arm, old x86).

    >>> simd_flags("AVX2")[-1]
    '-DCPU_CAPABILITY_AVX2'
    >>> simd_flags("SVE256")
    ()
    """
    return _ISA_FLAGS.get(capability, ())


@functools.cache
def load_extension() -> Extension:
    """Build or reload the kernels; never raises. O(build) the first time on a machine.

    Cached per process on purpose: a loaded shared library is process-wide by nature, and so
    is its op registration; caching keeps the failure warning to one per process. All other
    state (the autotuner and its decisions) lives in ``NativeBackend`` objects.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    flags = simd_flags(capability)
    isa = capability.lower() if flags else "portable"
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=f"daf_kernels_{isa}",
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=[*BASE_FLAGS, *flags, f"-DDAF_HEADERS_HASH={_headers_hash()}"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(SOURCE_DIR)],
            verbose=False,
        )
        from daf.kernels import layout_ops, mask_ops, ops, reduce_ops

        ops.register_native(module)
        mask_ops.register_native(module)
        layout_ops.register_native(module)
        reduce_ops.register_native(module)
    except Exception as error:  # compiler missing, build error, loader error: all mean "use the reference"
        reason = f"{type(error).__name__}: {_first_line(error)}"
        warnings.warn(f"DAF native kernels unavailable, using the reference codec ({reason})",
                      RuntimeWarning, stacklevel=2)
        return Extension(None, f"not loaded: {reason}")
    return Extension(module, f"loaded ({module.build_info()}; {platform.machine()}, torch {torch.__version__})")


def _headers_hash() -> str:
    """Digest of the headers: torch versions an extension by its sources and flags only,
    so a header change must show up in the flags to trigger a rebuild."""
    digest = hashlib.sha256()
    for header in HEADERS:
        digest.update((SOURCE_DIR / header).read_bytes())
    return digest.hexdigest()[:16]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else "no message"
