"""Memory for compressed activations: the store interface and its implementations."""

from daf.memory.store import HeapStore, Store

__all__ = ["Store", "HeapStore"]
