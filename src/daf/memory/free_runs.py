"""The free pages of a page pool, kept as runs of consecutive page ids.

A record of a few MiB takes hundreds of 4 KiB pages, nearly always one run: kept page by page
(a sorted list of ids) every ``put`` and ``release`` paid O(pages * log) Python work, about
0.3 ms per 2 MiB record each way. As runs, taking and giving back a record costs O(log(runs))
comparisons plus moving at most ``runs`` list entries; pages taken from one run are handed out
as a ``range`` (O(1), no list of ids), from several as a list.

The runs are two parallel sorted lists searched with the standard ``bisect`` (in C), not a
``sortedcontainers.SortedDict``: a pool holds a handful of runs, and every ``put`` and
``release`` of a training step comes here, where the SortedDict's own Python calls (about 15
per operation) cost more than the rest of the pool's bookkeeping (ResNet-18 at batch 128: 54
records a step, 1.5 ms taking and 2 ms giving back pages on the SortedDict; docs/paging.md).

>>> free = FreeRuns()
>>> free.add(0, 10)
>>> free.take(4)
range(0, 4)
>>> free.give([1, 2]); free.runs()
[(1, 3), (4, 10)]
>>> len(free)
8
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence

__all__ = ["FreeRuns"]


class FreeRuns:
    """Free page ids as disjoint, non-adjacent runs ``[start, end)``, lowest first."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # ascending
        self._ends: list[int] = []  # _ends[i]: the exclusive end of the run that starts at _starts[i]
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for start, end in zip(self._starts, self._ends):
            yield from range(start, end)

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self._count = 0

    def add(self, start: int, count: int) -> None:
        """Make ``count`` pages from ``start`` free; merges with the runs beside them.

        Raises ``ValueError`` if any of them is free already (a page freed twice)."""
        if count <= 0:
            return
        end = start + count
        starts, ends = self._starts, self._ends
        index = bisect_right(starts, start)  # runs before it: [0, index)
        if index > 0 and ends[index - 1] > start:
            raise ValueError(f"page {start} is free already (in the free run [{starts[index - 1]}, {ends[index - 1]}))")
        if index < len(starts) and starts[index] < end:
            raise ValueError(f"page {starts[index]} is free already (in the free run [{starts[index]}, {ends[index]}))")
        joins_before = index > 0 and ends[index - 1] == start
        joins_after = index < len(starts) and starts[index] == end
        if joins_before and joins_after:  # fills the gap between two runs
            ends[index - 1] = ends[index]
            del starts[index], ends[index]
        elif joins_before:
            ends[index - 1] = end
        elif joins_after:
            starts[index] = start
        else:
            starts.insert(index, start)
            ends.insert(index, end)
        self._count += count

    def give(self, pages: Sequence[int]) -> None:
        """Make ``pages`` (any order, no repeats) free again."""
        if not pages:
            return
        if isinstance(pages, range) and pages.step == 1:
            self.add(pages.start, len(pages))  # what take hands out: no list
            return
        if pages[-1] - pages[0] == len(pages) - 1 and pages == list(range(pages[0], pages[-1] + 1)):
            self.add(pages[0], len(pages))  # one run, compared in C
            return
        ordered = sorted(pages)
        first = previous = ordered[0]
        for page in ordered[1:]:
            if page != previous + 1:
                self.add(first, previous + 1 - first)
                first = page
            previous = page
        self.add(first, previous + 1 - first)

    def run_of(self, page: int) -> tuple[int, int]:
        """The free run ``[start, end)`` that holds ``page``; ``KeyError`` if it is not free. O(log(runs)).

        >>> free = FreeRuns(); free.add(0, 4); free.add(6, 2); free.run_of(7)
        (6, 8)
        """
        index = bisect_right(self._starts, page) - 1
        if index >= 0 and page < self._ends[index]:
            return self._starts[index], self._ends[index]
        raise KeyError(f"page {page} is not free")

    def take(self, count: int) -> Sequence[int]:
        """The ``count`` lowest free page ids, no longer free: a ``range`` when the lowest free run holds them
        all (the usual case), else a list. The caller checks ``len`` first."""
        if count > self._count:
            raise ValueError(f"{count} pages asked for, {self._count} free")
        starts, ends = self._starts, self._ends
        if count and starts and ends[0] - starts[0] >= count:
            start = starts[0]
            if ends[0] - start == count:
                del starts[0], ends[0]
            else:
                starts[0] = start + count
            self._count -= count
            return range(start, start + count)
        pages: list[int] = []
        while len(pages) < count:
            start, end = starts[0], ends[0]
            stop = min(end, start + count - len(pages))
            pages.extend(range(start, stop))
            if stop < end:
                starts[0] = stop
            else:
                del starts[0], ends[0]
        self._count -= count
        return pages

    def _check(self) -> None:
        """Assert the runs are disjoint, non-adjacent and add up to the count. O(runs)."""
        assert len(self._starts) == len(self._ends)
        previous_end = None
        total = 0
        for start, end in zip(self._starts, self._ends):
            assert start < end, (start, end)
            assert previous_end is None or previous_end < start, (previous_end, start)
            previous_end = end
            total += end - start
        assert total == self._count, (total, self._count)
