"""The free pages of a page pool, kept as runs of consecutive page ids.

A record of a few MiB takes hundreds of 4 KiB pages, nearly always one run: kept page by page
(a sorted list of ids) every ``put`` and ``release`` paid O(pages * log) Python work, about
0.3 ms per 2 MiB record each way. As runs, taking and giving back a record costs O(runs it
touches * log(runs)); pages taken from one run are handed out as a ``range`` (O(1), no list of
ids), from several as a list.

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

from collections.abc import Iterator, Sequence

from sortedcontainers import SortedDict

__all__ = ["FreeRuns"]


class FreeRuns:
    """Free page ids as disjoint, non-adjacent runs ``[start, end)``, lowest first."""

    def __init__(self) -> None:
        self._runs = SortedDict()  # start -> end (exclusive)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for start, end in self._runs.items():
            yield from range(start, end)

    def runs(self) -> list[tuple[int, int]]:
        return list(self._runs.items())

    def clear(self) -> None:
        self._runs.clear()
        self._count = 0

    def add(self, start: int, count: int) -> None:
        """Make ``count`` pages from ``start`` free; merges with the runs beside them.

        Raises ``ValueError`` if any of them is free already (a page freed twice)."""
        if count <= 0:
            return
        end = start + count
        index = self._runs.bisect_right(start)
        if index > 0:
            before_start, before_end = self._runs.peekitem(index - 1)
            if before_end > start:
                raise ValueError(f"page {start} is free already (in the free run [{before_start}, {before_end}))")
        if index < len(self._runs):
            after_start, after_end = self._runs.peekitem(index)
            if after_start < end:
                raise ValueError(f"page {after_start} is free already (in the free run [{after_start}, {after_end}))")
            if after_start == end:
                end = after_end
                del self._runs[after_start]
        if index > 0 and before_end == start:
            start = before_start
        self._runs[start] = end
        self._count += count

    def give(self, pages: Sequence[int]) -> None:
        """Make ``pages`` (any order, no repeats) free again."""
        if not pages:
            return
        if isinstance(pages, range) and pages.step == 1:
            self.add(pages.start, len(pages))  # what take hands out: O(log(runs)), no list
            return
        if pages[-1] - pages[0] == len(pages) - 1 and pages == list(range(pages[0], pages[-1] + 1)):
            self.add(pages[0], len(pages))  # the usual case: one run, compared in C
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
        index = self._runs.bisect_right(page) - 1
        if index >= 0:
            start, end = self._runs.peekitem(index)
            if page < end:
                return start, end
        raise KeyError(f"page {page} is not free")

    def take(self, count: int) -> Sequence[int]:
        """The ``count`` lowest free page ids, no longer free: a ``range`` when the lowest free run holds them
        all (the usual case), else a list. The caller checks ``len`` first."""
        if count > self._count:
            raise ValueError(f"{count} pages asked for, {self._count} free")
        if count and self._runs:
            start, end = self._runs.peekitem(0)
            if end - start >= count:
                del self._runs[start]
                if start + count < end:
                    self._runs[start + count] = end
                self._count -= count
                return range(start, start + count)
        pages: list[int] = []
        while len(pages) < count:
            start, end = self._runs.popitem(0)
            stop = min(end, start + count - len(pages))
            pages.extend(range(start, stop))
            if stop < end:
                self._runs[stop] = end
        self._count -= count
        return pages

    def _check(self) -> None:
        """Assert the runs are disjoint, non-adjacent and add up to the count. O(runs)."""
        previous_end = None
        total = 0
        for start, end in self._runs.items():
            assert start < end, (start, end)
            assert previous_end is None or previous_end < start, (previous_end, start)
            previous_end = end
            total += end - start
        assert total == self._count, (total, self._count)

