"""DAF's native kernels and allocator shim, compiled into the wheel when torch is importable at build time.

pyproject.toml holds the metadata; this file only adds the extensions. Building them needs torch, so
install torch first and build without isolation (``scripts/setup.sh``)::

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install --no-build-isolation -e .        # or: pip wheel --no-build-isolation .

An isolated build (plain ``pip install .``) would have to install a torch of its own to build against,
which pip would resolve to a newer, CUDA one: torch is deliberately not a build requirement. Without torch,
or without a compiler, the wheel is pure Python, and the kernels are built on first use (about 30 s, once
per machine; ``daf.native_status()`` says which happened). ``DAF_BUILD_KERNELS`` picks the builds:
"all" (default: AVX-512, AVX2 and portable on x86-64, portable elsewhere), "native" (this machine's
only: what ``scripts/setup.sh`` builds, a third of the time) or "none".
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "src" / "daf" / "kernels"


def _load_alone(name: str, path: Path):
    """A module of DAF by its file (importing ``daf`` would import all of DAF): the flags and the build key
    the run-time loader checks come from the same code."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _isas(build, choice: str) -> list[str]:
    import torch

    if choice == "none":
        return []
    if choice == "native":
        return [build.isa_name(torch.backends.cpu.get_cpu_capability())]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return ["avx512", "avx2", "portable"] if x86 else ["portable"]


def _say(message: str) -> None:
    print(f"daf: {message}", file=sys.stderr, flush=True)


def _extensions() -> dict:
    """``ext_modules`` and ``cmdclass`` for ``setup``: empty when torch cannot be imported here."""
    choice = os.environ.get("DAF_BUILD_KERNELS", "all")
    if choice not in ("all", "native", "none"):
        raise SystemExit(f"DAF_BUILD_KERNELS must be all, native or none, got {choice!r}")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say("torch is not importable at build time (an isolated build?): no kernels in this wheel; they are "
             "built on first use (install torch first, then pip install --no-build-isolation)")
        return {}
    build = _load_alone("_daf_kernels_build", KERNELS / "build.py")
    shim = _load_alone("_daf_allocator_shim", ROOT / "src" / "daf" / "allocator" / "shim.py")

    class OptionalBuildExtension(BuildExtension):
        """A kernel that does not compile leaves the wheel without it (built on first use), never fails the install."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as error:  # no compiler, an old one, no ninja: DAF still installs
                _say(f"{ext.name} not built ({build.failure_cause(error)}): it is built on first use instead")

    # -g0: no debug info (Python's own CFLAGS ask for it), 0.9 MiB per build instead of 9.
    extensions = [CppExtension(name=f"daf.kernels._native_{isa}", sources=[str(KERNELS.relative_to(ROOT) / "csrc" / s)
                                                                            for s in build.SOURCES],
                               include_dirs=[str(KERNELS / "csrc")],
                               extra_compile_args={"cxx": [*build.compile_flags(isa), "-g0"]},
                               extra_link_args=["-fopenmp"])
                  for isa in _isas(build, choice)]
    if extensions:  # the allocator's shim: a plain library (loaded with ctypes) that links against c10
        extensions.append(CppExtension(name="daf.allocator._shim", sources=[str(shim.SOURCE.relative_to(ROOT))],
                                       extra_compile_args={"cxx": [*shim.compile_flags(), "-g0"]}))
    return {"ext_modules": extensions, "cmdclass": {"build_ext": OptionalBuildExtension}} if extensions else {}


setup(**_extensions())
