"""Where compressed activations live between forward and backward.

``Store`` is the interface the runtime talks to; ``HeapStore`` keeps each
``Packed`` as an ordinary tensor allocation (no budget, no paging).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from daf.format import Packed
from daf.memory.errors import StoreClosed

__all__ = ["Store", "HeapStore", "lookup"]

_Record = TypeVar("_Record")


def lookup(records: dict[int, _Record], ref: int) -> _Record:
    """``records[ref]``, or a ``KeyError`` that says the record is gone. O(1)."""
    try:
        return records[ref]
    except KeyError:
        raise KeyError(f"activation record {ref} is not stored (already released?)") from None


class Store(Protocol):
    def put(self, packed: Packed, importance: float, site: str) -> int:
        """Keep ``packed``; return a reference for ``get`` and ``release``."""

    def get(self, ref: int) -> Packed:
        """The record stored under ``ref`` (possibly re-encoded at fewer bits under a budget)."""

    def release(self, ref: int) -> None:
        """Forget ``ref``; its bytes are free for the next ``put``."""

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None:
        """Refuse further puts (``StoreClosed``) and stop any worker thread; records already put stay
        readable until released (backward may run after the model is unwrapped), and the store's memory
        goes with the last of them. Idempotent."""


class HeapStore:
    """Each record is its own tensor allocation. O(1) per operation."""

    def __init__(self) -> None:
        self._records: dict[int, Packed] = {}
        self._next_ref = 0
        self._in_use = 0
        self._high_water = 0
        self._closed = False

    def put(self, packed: Packed, importance: float, site: str) -> int:
        if self._closed:
            raise StoreClosed(site)
        ref = self._next_ref
        self._next_ref += 1
        self._records[ref] = packed
        self._in_use += packed.nbytes
        self._high_water = max(self._high_water, self._in_use)
        return ref

    def get(self, ref: int) -> Packed:
        return lookup(self._records, ref)

    def release(self, ref: int) -> None:
        packed = self._records.pop(ref, None)
        if packed is not None:
            self._in_use -= packed.nbytes

    def __len__(self) -> int:
        return len(self._records)

    def stats(self) -> dict[str, Any]:
        return {"records": len(self._records), "bytes_in_use": self._in_use, "high_water_bytes": self._high_water}

    def close(self) -> None:
        self._closed = True  # each record is its own allocation: it is freed by its release
