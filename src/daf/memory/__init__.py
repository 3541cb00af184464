"""Memory for compressed activations: the store interface and its implementations."""

from daf.codec import Codec
from daf.config import Config
from daf.memory.store import HeapStore, Store

__all__ = ["Store", "HeapStore", "make_store"]


def make_store(config: Config, codec: Codec) -> Store:
    """The store for ``config``; ``codec`` is what a store re-encodes with when it demotes."""
    if config.budget is not None:
        raise NotImplementedError("Config.budget needs the page pool, which is not implemented yet")
    return HeapStore()
