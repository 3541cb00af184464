"""Memory for compressed activations: the store interface and its implementations."""

from daf.codec import Codec
from daf.config import Config
from daf.memory.errors import OutOfBudget, SpillError
from daf.memory.paged import PagedStore
from daf.memory.store import HeapStore, Store

__all__ = ["Store", "HeapStore", "PagedStore", "OutOfBudget", "SpillError", "make_store"]


def make_store(config: Config, codec: Codec) -> Store:
    """The store for ``config``: the paged store, with or without a budget; ``codec`` is what it
    re-encodes with when it demotes. (Measured against ``HeapStore`` in docs/paging.md: same step
    time, flat RSS under varying shapes.)"""
    return PagedStore(config, codec)
