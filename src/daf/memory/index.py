"""An ordered index of stored activations (importance first), on ``sortedcontainers``.

Items are any objects with ``importance`` (float, larger is more important) and ``seq``
(int, unique: the pack order) attributes, which must not change while the item is
indexed. The default order is least important first, ties broken by pack order
(earlier packed = needed later by backward = less important).

>>> from types import SimpleNamespace as Item
>>> index = ImportanceIndex()
>>> for seq, importance in enumerate([3.0, 1.0, 2.0]):
...     index.add(Item(importance=importance, seq=seq))
>>> index.least().importance, len(index)
(1.0, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sortedcontainers import SortedKeyList

__all__ = ["ImportanceIndex", "by_importance", "by_need"]


def by_importance(item: Any) -> tuple[float, int]:
    """Least important first; among equals, the earliest packed."""
    return (item.importance, item.seq)


def by_need(item: Any) -> int:
    """The order backward needs records in: reverse pack order."""
    return -item.seq


class ImportanceIndex:
    """Items sorted by ``key`` (``by_importance`` unless told). Not thread-safe: its owner locks."""

    def __init__(self, key: Callable[[Any], Any] = by_importance) -> None:
        self._key = key
        self._items = SortedKeyList(key=key)

    def add(self, item: Any) -> None:
        """Index ``item``. Runtime complexity: O(log(n))."""
        self._items.add(item)

    def remove(self, item: Any) -> None:
        """Forget ``item``; ``ValueError`` if it is not indexed. Runtime complexity: O(log(n))."""
        self._items.remove(item)

    def discard(self, item: Any) -> None:
        """Forget ``item`` if it is indexed. Runtime complexity: O(log(n))."""
        self._items.discard(item)

    def least(self) -> Any | None:
        """The first item in key order (the least important), or None when empty. O(log(n))."""
        return self._items[0] if self._items else None

    def __contains__(self, item: Any) -> bool:
        """Runtime complexity: O(log(n))."""
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        """Items in key order, least important first."""
        return iter(self._items)

    def _check(self) -> None:
        """Assert every invariant: sortedcontainers' own, strict key order, each item once. O(n)."""
        self._items._check()
        keys = [self._key(item) for item in self._items]
        assert all(a < b for a, b in zip(keys, keys[1:])), "keys are not strictly increasing"
        assert len({id(item) for item in self._items}) == len(self._items), "an item is indexed twice"
