"""Load the native format-1 kernels: the ones built at install when they match, else build them here once.

``pip install --no-build-isolation .`` (``scripts/setup.sh``; setup.py) compiles ``csrc/bindings.cpp`` into
the wheel, one module per instruction set (``daf.kernels._native_avx512``, ``_native_avx2``,
``_native_portable``). At run time the one for ``torch.backends.cpu.get_cpu_capability()`` is imported if
its ``build_key`` (the digest of csrc/, the flags and torch's version) is this checkout's and this torch's.
Otherwise ``torch.utils.cpp_extension.load`` compiles it once per source/flag version into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``; about 30 s, said in
one line) and reloads the cached library afterwards (about 0.01 s). The SIMD flags follow the CPU
capability: without the matching ``CPU_CAPABILITY`` defines ``at::vec::Vectorized`` silently falls back to
its slow generic version. ``DAF_PREBUILT_KERNELS=0`` ignores the kernels built at install.
On success the kernels become the CPU implementation of the ``torch.ops.daf`` ops
(``register_native`` of ``daf.kernels.ops``, ``mask_ops``, ``layout_ops``, ``reduce_ops`` and ``channel_ops``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import platform
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["Extension", "load_extension", "simd_flags", "isa_name", "compile_flags", "build_key", "failure_cause",
           "ISAS", "PREBUILT_ENV"]

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp",)
HEADERS = ("channels.h", "columns.h", "format1.h", "codes.h", "codes_avx2.h", "codes_avx512.h", "kernels.h", "masks.h", "nonzeros.h", "transpose.h")
PREBUILT_ENV = "DAF_PREBUILT_KERNELS"

# -ffp-contract=off: the reference rounds a * b + c twice; a contracted FMA would round once.
BASE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
_ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"),
}
# The module suffix of each build, by torch's capability name ("DEFAULT" and anything else: portable).
ISAS = {"avx512": "AVX512", "avx2": "AVX2", "portable": "DEFAULT"}


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


def isa_name(capability: str) -> str:
    """The build's name for torch's CPU capability name.

    >>> isa_name("AVX512"), isa_name("AVX2"), isa_name("SVE256")
    ('avx512', 'avx2', 'portable')
    """
    return capability.lower() if simd_flags(capability) else "portable"


def build_key(isa: str) -> str:
    """What the kernels of ``isa`` must have been built from to be used: a digest of csrc/, the flags and
    torch's version, as a C identifier (it is compiled in as ``-DDAF_BUILD_KEY=...``). O(size of csrc/)."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join((*BASE_FLAGS, *simd_flags(ISAS[isa]), torch.__version__)).encode())
    return "k" + digest.hexdigest()[:16]


def compile_flags(isa: str) -> list[str]:
    """The C++ flags of the ``isa`` build, at install (setup.py) and on first use alike."""
    return [*BASE_FLAGS, *simd_flags(ISAS[isa]), f"-DDAF_BUILD_KEY={build_key(isa)}"]


@functools.cache
def load_extension() -> Extension:
    """Load the kernels built at install, or build them; never raises. O(build) the first time on a machine
    without matching kernels from the install.

    Cached per process on purpose: a loaded shared library is process-wide by nature, and so
    is its op registration; caching keeps the failure warning to one per process. All other
    state (the autotuner and its decisions) lives in ``NativeBackend`` objects.
    """
    isa = isa_name(torch.backends.cpu.get_cpu_capability())
    module, why_not = _prebuilt(isa)
    origin = "built at install"
    try:
        if module is None:
            module, origin = _build_here(isa, why_not), f"built on first use: {why_not}"
        from daf.kernels import channel_ops, layout_ops, mask_ops, ops, reduce_ops

        ops.register_native(module)
        mask_ops.register_native(module)
        layout_ops.register_native(module)
        reduce_ops.register_native(module)
        channel_ops.register_native(module)
    except Exception as error:  # compiler missing, build error, loader error: all mean "use the reference"
        reason = failure_cause(error)
        warnings.warn(f"DAF native kernels unavailable, using the reference codec ({reason})",
                      RuntimeWarning, stacklevel=2)
        return Extension(None, f"not loaded: {reason}")
    where = f"{platform.machine()}, torch {torch.__version__}"
    return Extension(module, f"loaded ({module.build_info()}; {origin}; {where})")


def _prebuilt(isa: str) -> tuple[ModuleType | None, str]:
    """The kernels of ``isa`` built at install, when they were built from these sources for this torch;
    else None and why not."""
    if os.environ.get(PREBUILT_ENV, "1") == "0":
        return None, f"{PREBUILT_ENV}=0"
    try:
        module = importlib.import_module(f"daf.kernels._native_{isa}")
    except ModuleNotFoundError:
        return None, f"none were built at install for {isa}"
    except ImportError as error:  # built against another torch or libstdc++
        return None, f"the {isa} kernels built at install do not load ({failure_cause(error)})"
    if getattr(module, "build_key", lambda: None)() != build_key(isa):
        return None, f"the {isa} kernels built at install are for other sources or another torch"
    return module, ""


class _ToolMissing(RuntimeError):
    """A build tool is not installed: its message is the whole cause."""


def _build_here(isa: str, why_not: str) -> ModuleType:
    """Compile (or reload from torch's extension cache) the ``isa`` kernels; says so in one line when it
    compiles. Raises ``_ToolMissing`` at once, not after a failed command, when the compiler or ninja is absent."""
    from torch.utils import cpp_extension

    compiler = (os.environ.get("CXX") or "c++").split()[0]  # CXX may carry a launcher or flags ("ccache g++")
    if shutil.which(compiler) is None:
        raise _ToolMissing(f"{compiler} not found on PATH: install a C++ compiler (apt-get install g++) or set CXX")
    if not cpp_extension.is_ninja_available():
        raise _ToolMissing("ninja not found: pip install ninja")
    # The key in the name: every source version its own cache entry, so that checkouts sharing one
    # TORCH_EXTENSIONS_DIR never rebuild each other's kernels, and one found there is the one wanted.
    name = f"daf_kernels_{isa}_{build_key(isa)}"
    if _will_compile(name):
        print(f"DAF: building the native kernels for this CPU ({isa}) with {compiler}: about 30 s, once "
              f"({why_not})", file=sys.stderr, flush=True)
    return cpp_extension.load(name=name, sources=[str(SOURCE_DIR / s) for s in SOURCES],
                              extra_cflags=compile_flags(isa), extra_ldflags=["-fopenmp"],
                              extra_include_paths=[str(SOURCE_DIR)], verbose=False)


def _will_compile(name: str) -> bool:
    """Whether torch's extension cache lacks ``name``'s library (the name holds the build key: one there
    was built from these sources and flags)."""
    return not (extension_root() / name / f"{name}.so").exists()


def extension_root() -> Path:
    """The folder where ``cpp_extension.load`` builds and caches extensions: ``TORCH_EXTENSIONS_DIR``, else
    torch's default root with its per-interpreter folder (``py311_cpu``), as torch itself names it; the default
    root alone was checked before, so every process said it was building when it only reloaded."""
    from torch.utils import cpp_extension

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen is not None:
        return Path(chosen)
    version = torch.version
    accelerator = (f"rocm{version.hip.replace('.', '')}" if version.hip is not None
                   else f"cu{version.cuda.replace('.', '')}" if version.cuda is not None else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{accelerator}"


def failure_cause(error: BaseException) -> str:
    """Why a build or load failed, in one line: the compiler's first error (torch's message starts with
    the failed command, which says nothing), else the message's first line.

    >>> failure_cause(RuntimeError("Error building extension 'x': [1/2] c++ -MMD -O3 ...\\n"
    ...                            "bindings.cpp:7:10: fatal error: pybind11/pybind11.h: No such file\\n"))
    'RuntimeError: bindings.cpp:7:10: fatal error: pybind11/pybind11.h: No such file'
    """
    if isinstance(error, _ToolMissing):
        return str(error)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower() or "undefined symbol" in line]
    text = errors[0] if errors else lines[0] if lines else "no message"
    return f"{type(error).__name__}: {text}"
