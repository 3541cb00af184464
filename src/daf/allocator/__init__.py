"""Which malloc the process's tensors come from: part of DAF's memory design.

glibc's malloc keeps the heap that forward's full-size temporaries and backward's gradients once
touched, so activations stored 12x smaller barely move peak RSS; a well-kept allocator returns and
reuses that memory (measured: ``../docs/allocator.md``). This package finds such an allocator on the
machine and says how to use it, for a whole process (``LD_PRELOAD``) or, in-process, for PyTorch's
CPU tensors.

It stands alone: an fp32 run that never calls ``daf.wrap`` gets the same allocator with
``daf.allocator.install()`` before it allocates its model and data (``daf.wrap`` calls it itself)::

    import daf.allocator
    daf.allocator.install()          # "auto": tcmalloc if found, else the system's, with one warning
    print(daf.allocator.status())    # AllocatorStatus(name='tcmalloc', mode='in-process', ...)
"""

from daf.allocator.libraries import (ALLOCATORS, INSTALL_HINTS, PREFERENCE, Resolved, decommit_env, find_library,
                                     preload_env, resolve)
from daf.allocator.native import (AllocatorStatus, TensorBytes, decommit_freed_memory, install, release_free_memory,
                                  status, tensor_bytes)

__all__ = ["ALLOCATORS", "INSTALL_HINTS", "PREFERENCE", "Resolved", "decommit_env", "find_library", "preload_env",
           "resolve", "AllocatorStatus", "TensorBytes", "install", "status", "tensor_bytes", "release_free_memory",
           "decommit_freed_memory"]
