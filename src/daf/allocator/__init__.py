"""Which malloc the process's tensors come from: part of DAF's memory design.

glibc's malloc keeps the heap that forward's full-size temporaries and backward's gradients once
touched, so activations stored 12x smaller barely move peak RSS; a well-kept allocator returns and
reuses that memory (measured: ``../docs/allocator.md``). This package finds such an allocator on the
machine and says how to use it, for a whole process (``LD_PRELOAD``) or, in-process, for PyTorch's
CPU tensors.
"""

from daf.allocator.libraries import (ALLOCATORS, INSTALL_HINTS, PREFERENCE, Resolved, decommit_env, find_library,
                                     preload_env, resolve)

__all__ = ["ALLOCATORS", "INSTALL_HINTS", "PREFERENCE", "Resolved", "decommit_env", "find_library", "preload_env",
           "resolve"]
