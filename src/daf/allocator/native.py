"""Making an allocator library PyTorch's CPU allocator inside a running process.

The library is loaded beside the system malloc (``csrc/allocator.cpp``): only tensors that
PyTorch allocates from then on come from it. A process started with the library in
``LD_PRELOAD`` (``daf run``) has it everywhere already and needs nothing here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from daf.allocator import shim
from daf.allocator.libraries import ALLOCATORS, resolve

__all__ = ["AllocatorStatus", "TensorBytes", "install", "status", "preloaded", "tensor_bytes", "release_free_memory",
           "decommit_freed_memory", "decommits", "huge_pages", "transparent_huge_pages"]

_DECOMMIT = b"tcmalloc.aggressive_memory_decommit"
# PyTorch's own switch for its CPU allocator (c10/core/alloc_cpu.cpp), read at its first allocation.
_TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"
_HUGE_PAGES_FROM = 2 << 20  # PyTorch's threshold for the same advice
# Tensors from this size on are DAF's large blocks (csrc/allocator.cpp): a step's full-size tensors.
LARGE_BLOCKS_FROM = 8 << 20

SOURCE = shim.SOURCE


@dataclass(frozen=True)
class AllocatorStatus:
    """Where this process's CPU tensors come from.

    ``mode``: "in-process" (installed by DAF as PyTorch's CPU allocator), "preloaded" (the
    library is in ``LD_PRELOAD``: every malloc of the process is its), or "system".
    """

    name: str
    mode: str
    path: str | None
    reason: str


def preloaded() -> AllocatorStatus | None:
    """The allocator in this process's ``LD_PRELOAD`` that is mapped into it, if any."""
    wanted = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if not wanted:
        return None
    try:
        mapped = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for path in wanted:
        base = os.path.basename(path)
        for name, filenames in ALLOCATORS.items():
            if base in filenames and base in mapped:
                return AllocatorStatus(name, "preloaded", path, f"{name} is preloaded (LD_PRELOAD={path})")
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    """The compiled shim: the one built at install when it matches these sources and this torch, else
    built on first use into torch's extension cache (a few seconds; ``daf.allocator.shim``)."""
    library = _installed_library()
    if library is None:
        from torch.utils import cpp_extension

        path = cpp_extension.load(name=f"daf_allocator_{shim.build_key()}", sources=[str(SOURCE)],
                                  extra_cflags=shim.compile_flags(), is_python_module=False, verbose=False)
        library = ctypes.CDLL(path)
    library.daf_allocator_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    library.daf_allocator_install.restype = ctypes.c_int
    library.daf_allocator_path.restype = ctypes.c_char_p
    library.daf_allocator_active.restype = ctypes.c_int
    for counter in (library.daf_allocator_allocations, library.daf_allocator_frees):
        counter.restype = ctypes.c_uint64
    for counter in (library.daf_allocator_live_bytes, library.daf_allocator_peak_bytes):
        counter.restype = ctypes.c_int64
    library.daf_allocator_set_huge_pages_from.argtypes = [ctypes.c_size_t]
    library.daf_allocator_set_large_from.argtypes = [ctypes.c_size_t]
    for counter in (library.daf_allocator_large_from, library.daf_allocator_release_large_cache):
        counter.restype = ctypes.c_uint64
    library.daf_allocator_huge_pages_from.restype = ctypes.c_size_t
    return library


def _installed_library() -> ctypes.CDLL | None:
    """The shim built at install, if it was built from this source for this torch (else None: it is built
    here). A library that does not load (another torch's) counts as none."""
    path = shim.installed_path()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
        library.daf_allocator_build_key.restype = ctypes.c_char_p
        key = library.daf_allocator_build_key().decode()
    except (OSError, AttributeError):
        return None
    return library if key == shim.build_key() else None


@functools.cache
def install(name: str = "auto") -> AllocatorStatus:
    """Make ``name`` ("auto", "system" or an allocator's name) the allocator of PyTorch's CPU
    tensors in this process; never raises for a missing or broken library (one warning per
    process and name, naming the fix), only for an unknown name. Cached: process-wide by nature."""
    resolved = resolve(name)
    if name == "system":
        return status()
    already = preloaded()
    if already is not None:
        _serve_large_blocks_too(already)
        return status()
    if resolved.path is None:
        warnings.warn(f"DAF: {resolved.reason}; tensors use the system allocator, whose heap keeps the "
                      f"memory of freed temporaries (docs/allocator.md)", RuntimeWarning, stacklevel=3)
        return AllocatorStatus("system", "system", None, resolved.reason)
    try:
        library = _library()
    except Exception as error:  # no compiler, build or load error: the system allocator still works
        reason = f"could not build DAF's allocator shim ({type(error).__name__}: {str(error).splitlines()[0]})"
        warnings.warn(f"DAF: {reason}; tensors use the system allocator", RuntimeWarning, stacklevel=3)
        return AllocatorStatus("system", "system", None, reason)
    message = ctypes.create_string_buffer(512)
    current = status()
    if current.mode == "in-process" and current.path != resolved.path:
        # One CPU allocator per process: tensors keep coming from the first one installed.
        warnings.warn(f"DAF: {current.name} is PyTorch's CPU allocator already; {resolved.name} is not installed "
                      f"(the first wrap of the process decides)", RuntimeWarning, stacklevel=3)
        return current
    if library.daf_allocator_install(resolved.path.encode(), message, len(message)) != 0:
        reason = f"{resolved.name} at {resolved.path} could not be installed: {message.value.decode()}"
        warnings.warn(f"DAF: {reason}; tensors use the system allocator", RuntimeWarning, stacklevel=3)
        return AllocatorStatus("system", "system", None, reason)
    _configure(library)
    return status()


def _configure(library: ctypes.CDLL) -> None:
    if os.environ.get(_TORCH_HUGE_PAGES) == "1":  # PyTorch's switch, kept when DAF replaces its allocator
        library.daf_allocator_set_huge_pages_from(_HUGE_PAGES_FROM)
    if not decommits():  # freed large blocks kept as movable pages (csrc/allocator.cpp); decommit unmaps them
        library.daf_allocator_set_large_from(LARGE_BLOCKS_FROM)


def _serve_large_blocks_too(preload: AllocatorStatus) -> None:
    """In a process with the allocator preloaded, DAF's shim still serves the large blocks (the rest goes
    to the preloaded library, as before): a split heap is no better for being process-wide. Silent when
    the shim cannot be built or installed: the process keeps the preloaded library alone."""
    try:
        library = _library()
        if library.daf_allocator_install(preload.path.encode(), None, 0) == 0:
            _configure(library)
    except Exception:  # no compiler, or a load error: nothing is lost
        pass


def _shim_active() -> bool:
    """Whether DAF's shim is PyTorch's CPU allocator in this process (in-process, or beside a preload)."""
    return bool(_library.cache_info().currsize) and bool(_library().daf_allocator_active())


def status() -> AllocatorStatus:
    """What allocator this process's CPU tensors come from now, and why (and whether DAF's large
    blocks serve the tensors of 8 MiB and more)."""
    already = preloaded()
    if already is not None:
        return _with_large_blocks(already)
    if _library.cache_info().currsize:  # installed (or tried) in this process
        library = _library()
        path = library.daf_allocator_path().decode()
        if path and library.daf_allocator_active():
            name = next((n for n, files in ALLOCATORS.items() if os.path.basename(path) in files), path)
            return _with_large_blocks(AllocatorStatus(name, "in-process", path,
                                                      f"{name} is PyTorch's CPU allocator, installed by DAF"))
    return AllocatorStatus("system", "system", None, "the system allocator (DAF installed none in this process)")


def _with_large_blocks(current: AllocatorStatus) -> AllocatorStatus:
    large_from = _library().daf_allocator_large_from() if _shim_active() else 0
    if not large_from:
        return current
    return replace(current, reason=f"{current.reason}; tensors of {large_from >> 20} MiB and more come from "
                                   f"DAF's large blocks (docs/allocator.md)")


def release_free_memory() -> list[str]:
    """Give the memory that allocators hold free back to the system; the names of those asked.

    What loading left behind (the compressed dataset read into Python bytes, its decompression
    buffers) is freed before training but kept by tcmalloc for reuse, which a process with tcmalloc
    preloaded shows as 80-100 MiB more RSS at the start of training (docs/allocator.md). tcmalloc's
    ``MallocExtension_ReleaseFreeMemory`` and glibc's ``malloc_trim(0)`` return it; other allocators
    are left as they are. Costs page faults when the memory is needed again: call it between phases
    (after loading, before training), not per step.
    """
    asked = []
    if _shim_active():
        _library().daf_allocator_release_large_cache()
        asked.append("daf")
    tcmalloc = _tcmalloc()
    if tcmalloc is not None:
        try:
            tcmalloc.MallocExtension_ReleaseFreeMemory()
            asked.append("tcmalloc")
        except AttributeError:  # a tcmalloc build without the extension API
            pass
    try:
        ctypes.CDLL(None).malloc_trim(0)  # Python's objects stay on glibc unless tcmalloc is preloaded
        asked.append("glibc")
    except AttributeError:  # not glibc
        pass
    return asked


def _tcmalloc() -> ctypes.CDLL | None:
    """The tcmalloc library this process's tensors come from (in-process or preloaded), else None."""
    current = status()
    if current.name != "tcmalloc" or current.path is None:
        return None
    try:
        return ctypes.CDLL(current.path)
    except OSError:
        return None


def decommit_freed_memory() -> bool:
    """Make the allocator give every freed block back to the system at once (tcmalloc's aggressive
    decommit, ``MallocExtension_SetNumericProperty``): the process's RSS follows its live memory,
    and memory reused after a free is faulted in again. Tensors of 2 MiB and more allocated from
    then on are advised into transparent huge pages (``huge_pages``), which makes those faults 512
    times fewer, by DAF's allocator wherever it serves PyTorch (in-process or beside a preload);
    where it does not, PyTorch's own ``THP_MEM_ALLOC_ENABLE=1`` does it, which ``daf run
    --decommit`` sets. One warning when the kernel gives no huge pages (``transparent_hugepage``
    "never"): decommit still works, in 4 KiB faults. CPU memory only: a device's memory is its own
    allocator's. True when set; else (not on tcmalloc, or a build without the property) one warning
    per process and False. Process-wide: it stays set.
    """
    tcmalloc = _tcmalloc()
    current = status()
    reason = f"{current.name} is the allocator of this process's tensors"
    if tcmalloc is not None:
        try:
            if tcmalloc.MallocExtension_SetNumericProperty(_DECOMMIT, ctypes.c_size_t(1)):
                if _shim_active():
                    _library().daf_allocator_set_huge_pages_from(_HUGE_PAGES_FROM)
                    _library().daf_allocator_set_large_from(0)  # tcmalloc decommits; large blocks would keep
                if transparent_huge_pages() == "never":
                    _warn_once("DAF: Config.decommit without huge pages: the kernel's transparent_hugepage is "
                               "'never', so every reuse of freed memory faults 4 KiB at a time (about 1.7x the "
                               "step time of kept memory on a 2-core VM, 1.3x in huge pages; docs/allocator.md)")
                return True
            reason = f"tcmalloc does not know the property {_DECOMMIT.decode()}"
        except AttributeError as error:  # a build without the extension API
            reason = f"tcmalloc has no MallocExtension API ({error})"
    _warn_once(f"DAF: Config.decommit has no effect: {reason}; only tcmalloc gives freed memory back at once "
               f"(apt-get install libtcmalloc-minimal4, Config.allocator 'auto' or 'tcmalloc')")
    return False


def decommits() -> bool:
    """Whether this process's tensor allocator gives freed memory back at once (``decommit_freed_memory``)."""
    tcmalloc = _tcmalloc()
    value = ctypes.c_size_t(0)
    try:
        found = tcmalloc is not None and tcmalloc.MallocExtension_GetNumericProperty(_DECOMMIT, ctypes.byref(value))
    except AttributeError:
        return False
    return bool(found) and value.value == 1


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return None


def huge_pages() -> bool:
    """Whether large CPU tensors allocated from now on are advised into transparent huge pages: by
    DAF's allocator after ``decommit_freed_memory`` or when installed under PyTorch's own switch
    ``THP_MEM_ALLOC_ENABLE=1`` (in-process), else by PyTorch's allocator under that switch
    (preloaded or system). The kernel still decides:
    ``/sys/kernel/mm/transparent_hugepage/enabled`` set to "never" gives none."""
    if _shim_active():
        return bool(_library().daf_allocator_huge_pages_from())
    return os.environ.get(_TORCH_HUGE_PAGES, "0") == "1"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


@dataclass(frozen=True)
class TensorBytes:
    """Counts of the tensors allocated through DAF's in-process allocator since it was installed:
    live and peak are bytes as the library rounds them (its usable sizes)."""

    allocations: int
    frees: int
    live_bytes: int
    peak_bytes: int


def tensor_bytes(reset_peak: bool = False) -> TensorBytes | None:
    """Live and peak bytes of CPU tensors, exact and cheap (no profiler), when DAF installed the
    allocator in-process; None otherwise. ``reset_peak`` starts a new high-water mark after reading."""
    if not _library.cache_info().currsize or status().mode != "in-process":
        return None
    library = _library()
    figures = TensorBytes(int(library.daf_allocator_allocations()), int(library.daf_allocator_frees()),
                          int(library.daf_allocator_live_bytes()), int(library.daf_allocator_peak_bytes()))
    if reset_peak:
        library.daf_allocator_reset_peak()
    return figures
