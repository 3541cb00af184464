"""Finding an allocator's shared library and the environment that preloads it into a process.

>>> resolve("system")
Resolved(name='system', path=None, reason='the system allocator was asked for')
>>> preload_env("system", environ={})
{}
"""

from __future__ import annotations

import glob
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ALLOCATORS", "INSTALL_HINTS", "PREFERENCE", "Resolved", "decommit_env", "find_library", "preload_env",
           "resolve"]

# Shared-library names of each allocator, best first (tcmalloc's minimal build has no heap profiler).
ALLOCATORS: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
    "mimalloc": ("libmimalloc.so.2",),
}
# "auto" takes the first found; order from the measurement in docs/allocator.md
# (tcmalloc: least peak RSS and no step-time cost on ResNet-18, fp32 and DAF alike).
PREFERENCE: tuple[str, ...] = ("tcmalloc", "jemalloc", "mimalloc")
INSTALL_HINTS: dict[str, str] = {
    "tcmalloc": "apt-get install libtcmalloc-minimal4",
    "jemalloc": "apt-get install libjemalloc2",
    "mimalloc": "apt-get install libmimalloc2.0",
}
_NAMES = ("auto", "system", *ALLOCATORS)


@dataclass(frozen=True)
class Resolved:
    """The allocator a name stands for on this machine: its name, its library (None: the
    system's malloc) and a sentence saying why."""

    name: str
    path: str | None
    reason: str


def _search_dirs() -> list[str]:
    arch = f"{platform.machine()}-linux-gnu"
    dirs = [f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/local/lib", "/usr/lib", "/lib"]
    extra = os.environ.get("LD_LIBRARY_PATH", "")
    return [*[d for d in extra.split(":") if d], *dirs]


def find_library(name: str) -> str | None:
    """Absolute path of the named allocator's library on this machine, or None."""
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; allowed: {', '.join(ALLOCATORS)}")
    for filename in ALLOCATORS[name]:
        for directory in _search_dirs():
            for path in sorted(glob.glob(os.path.join(directory, filename))):
                if os.path.isfile(path):
                    return path
    return None


def resolve(name: str = "auto") -> Resolved:
    """What ``name`` ("auto", "system" or an allocator's name) means here; never raises for a
    missing library (the reason says what to install), only for an unknown name."""
    if name not in _NAMES:
        raise ValueError(f"allocator must be one of {', '.join(map(repr, _NAMES))}, got {name!r}")
    if name == "system":
        return Resolved("system", None, "the system allocator was asked for")
    candidates = PREFERENCE if name == "auto" else (name,)
    for candidate in candidates:
        path = find_library(candidate)
        if path is not None:
            return Resolved(candidate, path, f"{candidate} found at {path}")
    wanted = candidates[0]
    return Resolved("system", None, f"{wanted} not found; install it with `{INSTALL_HINTS[wanted]}`")


def preload_env(name: str = "auto", environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to add to a child process's environment so that it runs on the allocator:
    ``LD_PRELOAD`` with the library first ({} for the system allocator or when none is found)."""
    environ = os.environ if environ is None else environ
    resolved = resolve(name)
    if resolved.path is None:
        return {}
    existing = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if resolved.path in existing:
        return {}
    return {"LD_PRELOAD": ":".join([resolved.path, *existing])}


def decommit_env(name: str) -> dict[str, str]:
    """The variables that make a process started with ``name`` preloaded give freed memory back at
    once (tcmalloc's aggressive decommit) and put large tensors in huge pages (PyTorch's own switch,
    which it reads at its first allocation): ``Config.decommit`` for a whole process. {} unless
    ``name`` resolves to tcmalloc, the only allocator with it."""
    resolved = resolve(name)
    if resolved.name != "tcmalloc" or resolved.path is None:
        return {}
    return {"TCMALLOC_AGGRESSIVE_DECOMMIT": "true", "THP_MEM_ALLOC_ENABLE": "1"}
