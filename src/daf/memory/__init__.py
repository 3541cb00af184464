"""Memory for compressed activations: the store interface and its implementations.

Nothing here imports the codec: a store demotes through the ``reencode`` callable it is given.
"""

from daf.config import Config
from daf.memory.errors import OutOfBudget, SpillError, StoreClosed
from daf.memory.paged import PagedStore, Reencode
from daf.memory.store import HeapStore, Store

__all__ = ["Store", "HeapStore", "PagedStore", "Reencode", "OutOfBudget", "SpillError", "StoreClosed",
           "make_store"]


def make_store(config: Config, reencode: Reencode | None) -> Store:
    """The store for ``config``: the paged store, with or without a budget. ``reencode(packed, bits, seed)``
    is what it demotes with under a budget (a codec's ``reencode``); None: it only spills. (Measured
    against ``HeapStore`` in docs/paging.md: same step time, flat RSS under varying shapes.)"""
    return PagedStore(config, reencode)
