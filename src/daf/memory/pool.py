"""The page pool: memory DAF owns, reserved in large chunks and cut into fixed-size pages.

A record of ``n`` bytes takes ``ceil(n / page_size)`` pages from anywhere in the pool,
so records of any size fit wherever pages are free and cannot fragment it; a freed
page is handed out again by the next allocation. The lowest-numbered free pages go
first, which keeps most records in one contiguous run (read back as a view, no copy).

The pool grows by an increment derived from observed demand: at least what is
missing, at least the previous step's high-water mark of pages in use, and at least
``growth_fraction`` of what is reserved (so growth takes few chunks without
overshooting the demand by more than that fraction). It never grows past its limit
(the memory budget). A *step* ends whenever no page is in use; at that quiet moment
a pool made of several chunks is rebuilt as one chunk of the same size.

>>> pool = PagePool(page_size=4096, device="cpu")
>>> pages = pool.allocate(3)
>>> views = pool.write(pages, torch.arange(10000, dtype=torch.int64).to(torch.uint8))
>>> pool.read(pages, 10000)[:4].tolist()
[0, 1, 2, 3]
>>> pool.free(pages); pool.in_use_pages, pool.reserved_pages
(0, 3)
"""

from __future__ import annotations

import bisect
import ctypes
import math
import mmap
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from daf.memory.free_runs import FreeRuns

__all__ = ["PagePool", "PoolExhausted"]

def _huge_page_bytes() -> int:
    """The transparent huge page size (Linux), else 2 MiB."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as size:
            return int(size.read())
    except (OSError, ValueError):
        return 2 << 20


class _Mapping(NamedTuple):
    """A CPU chunk's anonymous mapping, and the unit in which its free pages go back to the system."""

    mapping: mmap.mmap
    unit: int


def _reserve(nbytes: int, device: torch.device, huge: int) -> tuple[torch.Tensor, _Mapping | None]:
    """uint8 [nbytes] on ``device``, and its mapping on the CPU. There an anonymous mapping of its own
    rather than malloc: a long-lived chunk on top of glibc's heap would keep every free byte below it
    resident (docs/memory.md); a mapping is outside the heap and is unmapped when dropped.
    Its pages cost RSS only once written. ``huge``: the transparent huge page size (``_huge_page_bytes``)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None
    # Private: MADV_DONTNEED then discards freed pages (a shared anonymous mapping, mmap's default,
    # would only unmap them from this process and keep their memory as shmem).
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    unit = mmap.PAGESIZE
    if nbytes >= huge and hasattr(mmap, "MADV_HUGEPAGE"):
        # Pages given back are faulted in again by the next forward: 4 KiB at a time that cost 0.65 ms
        # per MiB on this machine (26 ms per ResNet-18 step at batch 128), in huge pages 0.03.
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
            unit = huge
        except OSError:
            pass
    return torch.frombuffer(mapping, dtype=torch.uint8), _Mapping(mapping, unit)  # the tensor keeps it alive


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for two contiguous uint8 tensors of one size. On the CPU one ``memmove`` on this
    thread: ``copy_`` splits a copy above 32K elements over the intra-op threads, and when another
    process holds the other core the wait for that thread is what it costs (a 1.6 MB record: 12 ms
    against 60 us, measured on this 2-core machine under load)."""
    if dst.numel() != src.numel():
        raise ValueError(f"cannot copy {src.numel()} bytes into {dst.numel()}")
    if dst.is_cpu and src.is_cpu and dst.dtype == src.dtype == torch.uint8 and dst.is_contiguous() \
            and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src)


class PoolExhausted(MemoryError):
    """The pool would have to grow past its limit."""


class PagePool:
    """Fixed-size pages in uint8 chunks on one device. Not thread-safe: its owner locks.

    Attributes:
        page_size: bytes per page (a power of two).
        device: where the chunks live (any torch device).
        limit_pages: the most pages the pool may reserve; None for no limit.
    """

    def __init__(self, page_size: int, device: torch.device | str, limit_bytes: int | None = None,
                 growth_fraction: float = 1 / 32, min_growth_bytes: int = 0, return_pages: bool = False) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {page_size}")
        if not 0 < growth_fraction <= 1:
            raise ValueError(f"growth_fraction must be in (0, 1], got {growth_fraction}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.limit_pages = None if limit_bytes is None else limit_bytes // page_size
        self.growth_fraction = growth_fraction
        self.min_growth_pages = max(1, min_growth_bytes // page_size)
        self.return_pages = return_pages
        self._chunks: list[torch.Tensor] = []
        self._maps: list[_Mapping | None] = []  # each CPU chunk's mapping, to give freed pages back
        self._huge_page = _huge_page_bytes() if self.device.type == "cpu" else 0  # read once, not per chunk
        self._starts: list[int] = []  # first page id of each chunk, ascending
        self._free = FreeRuns()
        self.reserved_pages = 0
        self.in_use_pages = 0
        self.step_high_water = 0  # most pages in use since the last quiet moment
        self.last_step_high_water = 0
        self.high_water_pages = 0  # over the pool's life
        self.growths = 0
        self.compactions = 0

    # -- pages -----------------------------------------------------------------------------
    def pages_for(self, nbytes: int) -> int:
        """Pages a record of ``nbytes`` takes. O(1).

        >>> PagePool(4096, "cpu").pages_for(4097)
        2
        """
        return -(-nbytes // self.page_size)

    def allocate(self, count: int) -> Sequence[int]:
        """``count`` free page ids, lowest first (a ``range`` when they are one run), growing the pool if needed.

        Raises ``PoolExhausted`` when that would pass ``limit_pages``.
        Runtime complexity: O(count) in C plus O(runs taken * log(runs)).
        """
        if count > len(self._free):
            self._grow(count - len(self._free))
        pages = self._free.take(count)
        self.in_use_pages += count
        self.step_high_water = max(self.step_high_water, self.in_use_pages)
        self.high_water_pages = max(self.high_water_pages, self.in_use_pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back; the next ``allocate`` may hand them out. O(len(pages)) in C for one run.

        With ``return_pages``, on the CPU their memory also goes back to the system at once
        (``MADV_DONTNEED``): between steps the process no longer holds the pool's high-water mark
        (docs/paging.md; the step's peak, at the end of forward, is not lowered by it). The next
        forward faults them in again.
        """
        self._free.give(pages)
        self.in_use_pages -= len(pages)
        if self.return_pages:
            self._give_back(pages)
        if self.in_use_pages == 0:
            self._end_step()

    def _give_back(self, pages: Sequence[int]) -> None:
        """madvise away the whole units (system pages, or huge pages where the chunk has them) that lie in
        the free run around each run of ``pages``: only there is nothing live in them (with system pages
        larger than the pool's, 64 KiB on some Arm systems, a partly free one may hold a record)."""
        for chunk, first, _ in self._runs(pages):
            entry = self._maps[chunk]
            if entry is None:
                continue
            chunk_first = self._starts[chunk]
            chunk_end = chunk_first + self._chunks[chunk].numel() // self.page_size
            start, end = self._free.run_of(first)
            base = self._chunks[chunk].data_ptr()
            low = base + (max(start, chunk_first) - chunk_first) * self.page_size
            high = base + (min(end, chunk_end) - chunk_first) * self.page_size
            low, high = -(-low // entry.unit) * entry.unit, high // entry.unit * entry.unit
            if high > low:
                entry.mapping.madvise(mmap.MADV_DONTNEED, low - base, high - low)

    # -- bytes -----------------------------------------------------------------------------
    def write(self, pages: Sequence[int], payload: torch.Tensor) -> list[torch.Tensor]:
        """Copy ``payload`` (uint8 [n], contiguous, on this device, n <= pages * page_size) into ``pages``;
        returns the views written, one per contiguous run (``views``): a caller may keep a single one to
        read the bytes back without looking the pages up again.

        O(n) bytes copied, one copy per contiguous run of pages.
        """
        views = self.views(pages, payload.numel())
        offset = 0
        for view in views:
            _copy_bytes(view, payload[offset: offset + view.numel()])
            offset += view.numel()
        return views

    def read(self, pages: Sequence[int], nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes held in ``pages``: uint8 [nbytes].

        A view into the pool when the pages form one contiguous run (O(1)), else a
        contiguous copy (O(nbytes)). A view stays valid until the pages are freed.
        """
        views = self.views(pages, nbytes)
        if len(views) == 1:
            return views[0]
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        offset = 0
        for view in views:
            _copy_bytes(out[offset: offset + view.numel()], view)
            offset += view.numel()
        return out

    def views(self, pages: Sequence[int], nbytes: int) -> list[torch.Tensor]:
        """uint8 views of the first ``nbytes`` bytes of ``pages``, one per contiguous run, in order."""
        if nbytes > len(pages) * self.page_size:
            raise ValueError(f"{nbytes} bytes do not fit in {len(pages)} pages of {self.page_size} bytes")
        views = []
        left = nbytes
        for chunk, first, count in self._runs(pages):
            size = min(left, count * self.page_size)
            if size <= 0:
                break
            start = (first - self._starts[chunk]) * self.page_size
            views.append(self._chunks[chunk][start: start + size])
            left -= size
        return views

    def _runs(self, pages: Sequence[int]) -> Iterator[tuple[int, int, int]]:
        """(chunk index, first page, page count) of each run of consecutive pages inside one chunk."""
        i = 0
        while i < len(pages):
            chunk = bisect.bisect_right(self._starts, pages[i]) - 1
            end_of_chunk = self._starts[chunk] + self._chunks[chunk].numel() // self.page_size
            if pages[-1] - pages[i] == len(pages) - 1 - i and pages[-1] < end_of_chunk:
                yield chunk, pages[i], len(pages) - i  # sorted and gapless to the end: one run (the usual case)
                return
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1 and pages[j] < end_of_chunk:
                j += 1
            yield chunk, pages[i], j - i
            i = j

    # -- growth ----------------------------------------------------------------------------
    def _grow(self, short: int) -> None:
        """Reserve one more chunk of at least ``short`` pages, sized from observed demand."""
        want = max(short, self.last_step_high_water - self.reserved_pages,
                   math.ceil(self.reserved_pages * self.growth_fraction), self.min_growth_pages)
        if self.limit_pages is not None:
            want = min(want, self.limit_pages - self.reserved_pages)
            if want < short:
                raise PoolExhausted(f"the page pool needs {short} more pages of {self.page_size} bytes but its limit "
                                    f"is {self.limit_pages} pages and {self.reserved_pages} are reserved")
        self._add_chunk(want)
        self.growths += 1

    def _add_chunk(self, pages: int) -> None:
        chunk, mapping = _reserve(pages * self.page_size, self.device, self._huge_page)
        self._starts.append(self.reserved_pages)
        self._chunks.append(chunk)
        self._maps.append(mapping)
        self._free.add(self.reserved_pages, pages)
        self.reserved_pages += pages

    def _end_step(self) -> None:
        """Nothing is in use: remember the step's demand and merge the chunks into one."""
        self.last_step_high_water = self.step_high_water
        self.step_high_water = 0
        if len(self._chunks) > 1:
            total = self.reserved_pages
            self._chunks, self._maps, self._starts, self.reserved_pages = [], [], [], 0
            self._free.clear()
            self._add_chunk(total)
            self.compactions += 1

    # -- figures and invariants ------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return self.reserved_pages * self.page_size

    @property
    def in_use_bytes(self) -> int:
        return self.in_use_pages * self.page_size

    @property
    def chunks(self) -> int:
        return len(self._chunks)

    def _check(self) -> None:
        """Assert every invariant of the pool. O(pages)."""
        self._free._check()
        assert len(self._chunks) == len(self._starts)
        position = 0
        for start, chunk in zip(self._starts, self._chunks):
            assert start == position, (start, position)
            assert chunk.dtype == torch.uint8 and chunk.dim() == 1 and chunk.device == self.device
            assert chunk.numel() % self.page_size == 0 and chunk.numel() > 0
            position += chunk.numel() // self.page_size
        assert position == self.reserved_pages
        assert all(0 <= p < self.reserved_pages for p in self._free)
        assert self.in_use_pages + len(self._free) == self.reserved_pages
        assert 0 <= self.in_use_pages <= self.step_high_water <= self.high_water_pages
        if self.limit_pages is not None:
            assert self.reserved_pages <= self.limit_pages
