"""The paged store: payloads in DAF's page pool, ordered by importance, held within a budget.

Without a budget it is a page pool and nothing more. With ``Config.budget``, a ``put``
that would pass the budget first *demotes* the least important records (re-encodes
them at half their bits, down to ``Config.min_bits``), then *spills* the least
important to disk. A record that cannot fit even demoted as far as it goes with every
other payload on disk is written *straight* to disk (it never takes pages); only when
the disk cannot take it either does ``put`` raise ``OutOfBudget``. Once backward
starts (the first ``get`` after a ``put``), a worker thread reads spilled records
back into the pool in the order backward needs them (reverse pack order) as released
records make room; a record written straight to disk is read back when it is the
next one backward will ask for, into the pool if it fits by then, else into one
buffer outside the pool (at most one such buffer at a time).

The budget counts pages in use (whole pages) plus the exception side tables, which
stay in ordinary memory beside their records. Decoding and demotion need transient
memory for one decoded activation outside the budget, like any ``get``; so does the
payload of a record larger than the budget once it is read back (``staged_bytes``).

``close`` stops the worker and refuses further puts; what was put stays readable until released
(backward may run after the model is unwrapped), and the pools and the spill directory go with the
last release. Demotion goes through the ``reencode`` callable the store is given, so the memory layer
does not depend on the codec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import threading
import time
import warnings
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from daf.config import Config
from daf.format import Packed, payload_bytes
from daf.memory.errors import OutOfBudget, SpillError, StoreClosed
from daf.memory.index import ImportanceIndex, by_importance, by_need
from daf.memory.pool import PagePool
from daf.memory.spill import SpillHandle, SpillStore
from daf.memory.store import lookup

__all__ = ["PagedStore", "Reencode"]

Reencode = Callable[[Packed, int, int], Packed]
"""``reencode(packed, bits, seed)``: the same values coded at fewer ``bits`` (a codec's ``reencode``)."""


@dataclasses.dataclass(eq=False)
class _Record:
    """One stored activation: resident (``pages``), spilled (``spilled``), loading back (``loading``, into
    ``pages`` or ``staged``) or read back outside the pool (``staged``)."""

    ref: int
    seq: int
    site: str
    importance: float
    header: Packed  # the record's Packed with an empty payload: shape, bits, exception side table
    nbytes: int
    pages: Sequence[int] | None = None
    view: torch.Tensor | None = None  # its payload in the pool while it is resident in one run of pages (put's copy)
    spilled: SpillHandle | None = None
    loading: Future | None = None
    staged: torch.Tensor | None = None  # its payload read back outside the pool: it was too large for the budget
    direct: bool = False  # on disk since its put, when it could not fit in the pool; read back when next needed
    awaited: bool = False  # spilled since backward last asked for it: its next get is a hit or a miss
    released: bool = False
    failure: str | None = None  # why its read back failed: a message, never the exception (its traceback
    # would hold backward's frames, and through them the graph whose release would free this record)

    @property
    def side_bytes(self) -> int:
        return self.header.nbytes  # the empty payload adds nothing

    @property
    def device(self) -> torch.device:
        return self.header.payload.device


def _payload_bytes(packed: Packed) -> torch.Tensor:
    """The payload as uint8 [n], contiguous."""
    payload = packed.payload.reshape(-1)
    return payload if payload.dtype == torch.uint8 else payload.contiguous().view(torch.uint8)


def _goes_first(record: _Record, other: _Record | None) -> bool:
    """Whether ``record`` is less important than ``other`` (always, when there is no other)."""
    return other is None or by_importance(record) < by_importance(other)


def _with_payload(packed: Packed, payload: torch.Tensor) -> Packed:
    """``packed`` (of any ``Packed`` type) with another payload: a shallow copy, not ``dataclasses.replace``,
    which costs several times more on every put and get."""
    copied = object.__new__(type(packed))
    copied.__dict__.update(packed.__dict__)
    copied.payload = payload
    return copied


class PagedStore:
    """Activation records in a page pool per device, with an optional budget. Thread-safe.

    ``put``, ``get`` and ``release`` cost O(log n) index work plus the bytes they copy; a
    ``put`` under pressure also pays for the demotions (one decode and encode each) and
    spills (one file write each) it triggers. A payload handed out by ``get`` may be a
    view into the pool: it stays valid until the next ``put`` or ``release``.
    """

    def __init__(self, config: Config, reencode: Reencode | None = None) -> None:
        if reencode is not None and not callable(reencode):
            raise TypeError(f"PagedStore's reencode must be a callable (packed, bits, seed) -> Packed such as "
                            f"codec.reencode, or None; got {type(reencode).__name__}")
        self.page_size = config.page_size
        self.return_pages = config.return_pages
        self.budget = config.budget
        self.min_bits = config.min_bits
        self._reencode_with = reencode  # None: never demote, only spill
        self._seed = config.seed
        self._pools: dict[torch.device, PagePool] = {}
        self._records: dict[int, _Record] = {}
        self._resident = ImportanceIndex(by_importance)   # in the pool, may be spilled
        self._demotable = ImportanceIndex(by_importance)  # in the pool with bits > min_bits
        self._spilled = ImportanceIndex(by_need)           # on disk, next needed first (not those written directly)
        self._unasked = ImportanceIndex(by_need)           # under a budget: not asked for since put, next needed first
        self._spill = SpillStore(config.spill_dir) if self.budget is not None else None
        self._worker = ThreadPoolExecutor(1, "daf-prefetch") if self.budget is not None else None
        self._lock = threading.Lock()
        self._empty: dict[torch.device, torch.Tensor] = {}  # the headers' empty payload, one per device
        self._owner: int | None = None
        self._pending_releases: deque[int] = deque()
        self._next_ref = 0
        self._side = 0  # exception side tables of every record (they stay in memory)
        self._loading = 0  # page bytes held by reads in flight
        self._staged_bytes = 0  # payload read back outside the pool (outside the budget): one record at most
        self._payload = 0  # payload bytes of every record, wherever it is
        self._high_water = 0
        self._in_backward = False
        self._closed = False
        self.counters = dict.fromkeys(("demotions", "demoted_bytes_saved", "spills", "spilled_bytes", "direct_spills",
                                       "prefetches", "prefetch_hits", "prefetch_misses", "staged_reads"), 0)
        self.seconds = dict.fromkeys(("demote_seconds", "spill_write_seconds", "spill_wait_seconds"), 0.0)

    # -- locking ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the store's lock; releases asked for meanwhile (GC, other threads) run before it is let go."""
        self._acquire()
        try:
            yield
        finally:
            self._let_go()

    # put, get and release take the lock by these two directly: a generator context per call was a
    # measurable part of what the store costs a training step (54 records of ResNet-18 at batch 128)
    def _acquire(self) -> None:
        self._lock.acquire()
        self._owner = threading.get_ident()

    def _let_go(self) -> None:
        """Run the releases asked for meanwhile (GC, other threads), then let go of the lock."""
        try:
            while self._pending_releases:
                self._release_now(self._pending_releases.popleft())
        finally:
            self._owner = None
            self._lock.release()

    # -- the Store interface ---------------------------------------------------------------
    def put(self, packed: Packed, importance: float, site: str) -> int:
        """Keep ``packed``; return its reference. Under a budget it may demote and spill (``packed`` itself
        straight to disk when it cannot fit at all), and raises ``OutOfBudget`` when the disk cannot take it."""
        self._acquire()
        try:
            if self._closed:
                raise StoreClosed(site)
            self._in_backward = False
            record = _Record(self._next_ref, self._next_ref, site, float(importance), self._header(packed),
                             packed.payload.nbytes)
            payload = _payload_bytes(packed)
            if self.budget is not None:
                payload = self._make_room(record, packed, payload)
            if payload is not None:
                self._place(record, payload)
            self._next_ref += 1
            self._records[record.ref] = record
            if self.budget is not None:
                self._unasked.add(record)
            self._side += record.side_bytes
            self._payload += record.nbytes
            self._high_water = max(self._high_water, self._used)
            return record.ref
        finally:
            self._let_go()

    def get(self, ref: int) -> Packed:
        """The record under ``ref`` (at its current bits: demotion may have lowered them)."""
        self._acquire()
        try:
            record = lookup(self._records, ref)
            self._in_backward = True
            if self.budget is not None:
                self._unasked.discard(record)  # first, so the next record it hands the worker is the one after
            if self._worker is not None:
                self._schedule_prefetch()
            loading = record.loading
            if loading is None:
                return self._resident_or_read(record)
        finally:
            self._let_go()
        started = time.perf_counter()
        loading.exception()  # wait for the worker; an error it met is on the record
        with self._locked():
            self.seconds["spill_wait_seconds"] += time.perf_counter() - started
            return self._resident_or_read(record, waited=True)

    def release(self, ref: int) -> None:
        """Forget ``ref``: its pages are free at once and its spill file is deleted. Unknown refs are ignored."""
        self._pending_releases.append(ref)
        if self._owner == threading.get_ident():
            return  # called back from inside the store (garbage collection): runs when the lock is let go
        self._acquire()
        self._let_go()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def _used(self) -> int:
        """What the budget counts: pages in use (reads in flight included) plus the side tables."""
        return sum(pool.in_use_bytes for pool in self._pools.values()) + self._side

    # -- placing and reading records -------------------------------------------------------
    def _pool(self, device: torch.device) -> PagePool:
        pool = self._pools.get(device)
        if pool is None:
            if self.return_pages and device.type != "cpu":
                warnings.warn(f"DAF: Config.return_pages gives freed pages back on the CPU only; the page pool on "
                              f"{device} keeps them (its memory is the device allocator's)", stacklevel=2)
            pool = self._pools[device] = PagePool(self.page_size, device, self.budget, return_pages=self.return_pages)
        return pool

    def _place(self, record: _Record, payload: torch.Tensor) -> None:
        pool = self._pool(payload.device)
        record.pages = pool.allocate(pool.pages_for(payload.numel()))
        views = pool.write(record.pages, payload)
        if len(views) == 1:  # the usual case: get hands out this view without looking the pages up again
            record.view = views[0]
        self._index_resident(record)

    def _index_resident(self, record: _Record) -> None:
        if self.budget is None:
            return  # the indexes choose what to demote and spill: only a budget reads them
        self._resident.add(record)
        if self._can_demote(record):
            self._demotable.add(record)

    def _unplace(self, record: _Record) -> None:
        """Free the record's pages (it stays known to the store)."""
        if self.budget is not None:
            self._resident.discard(record)
            self._demotable.discard(record)
        self._pools[record.device].free(record.pages)
        record.pages = record.view = None

    def _resident_or_read(self, record: _Record, waited: bool = False) -> Packed:
        if record.failure is not None:
            raise SpillError(record.failure)  # a fresh one each time: nothing here keeps a traceback
        if record.awaited:
            hit = (record.pages is not None or record.staged is not None) and not waited
            self.counters["prefetch_hits" if hit else "prefetch_misses"] += 1
            record.awaited = False
        if record.pages is not None:
            payload = self._gather(record)
        elif record.staged is not None:
            payload = record.staged
        else:  # spilled and not read back yet: read it here, into memory outside the pool
            started = time.perf_counter()
            try:
                payload = self._spill.read(record.spilled, record.site, record.device)
            except SpillError as error:
                record.failure = str(error)
                self._spilled.discard(record)  # the worker must not try it again
                raise SpillError(record.failure) from None
            self.seconds["spill_wait_seconds"] += time.perf_counter() - started
        return _with_payload(record.header, payload)

    def _header(self, packed: Packed) -> Packed:
        """``packed`` with an empty payload (one shared per device): shape, bits, exception side table."""
        device = packed.payload.device
        empty = self._empty.get(device)
        if empty is None:
            empty = self._empty[device] = packed.payload.new_empty(0, dtype=torch.uint8)
        return _with_payload(packed, empty)

    def _gather(self, record: _Record) -> torch.Tensor:
        if record.view is not None:
            return record.view
        return self._pools[record.device].read(record.pages, record.nbytes)

    # -- the budget: demote, spill, refuse -------------------------------------------------
    def _cost(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size) * self.page_size

    def _make_room(self, record: _Record, packed: Packed, payload: torch.Tensor) -> torch.Tensor | None:
        """Make the budget hold ``record``; its payload (re-encoded if it was demoted), or None if it was spilled.

        Demotes, then spills, least important first; the incoming record takes its turn by its importance.
        A record that cannot fit even so goes straight to disk, at its own bits (disk is not short of room).
        """
        bits, smallest = self._fewest(record, packed)
        pinned = self._side + self._loading  # what cannot be spilled: exception side tables, reads in flight
        if pinned + record.side_bytes + smallest > self.budget:
            self._spill_direct(record, payload, smallest, (
                f"it takes {smallest} B at {bits} bits (as far as demotion goes) plus {record.side_bytes} B of "
                f"exceptions, and {pinned} B cannot be spilled (exception side tables, reads in flight)"))
            payload = None
        while self._used + record.side_bytes + (0 if payload is None else self._cost(payload.numel())) > self.budget:
            victim = self._demotable.least()
            if payload is not None and self._can_demote(record) and _goes_first(record, victim):
                packed = self._reencode(packed)
                record.header, record.nbytes = self._header(packed), packed.payload.nbytes
                payload = _payload_bytes(packed)
                continue
            if victim is not None:
                self._demote(victim)
                continue
            victim = self._resident.least()
            if payload is not None and _goes_first(record, victim):
                self._spill_payload(record, [payload])
                payload = None
            elif victim is not None:
                self._spill_out(victim)
            else:
                raise OutOfBudget(record.site, record.side_bytes, self.budget, self._used,
                                  "its exception side table does not fit beside what cannot be spilled")
        return payload

    def _fewest(self, record: _Record, packed: Packed) -> tuple[int, int]:
        """(bits, page bytes) of the record demoted as far as demotion goes (each step must free a page). O(1)."""
        bits, smallest, floor = packed.bits, self._cost(record.nbytes), self._floor(packed)
        while self._reencode_with is not None and bits > floor:
            fewer = max(floor, bits // 2)
            cost = self._cost(payload_bytes(packed.numel, fewer, packed.group_size))
            if cost >= smallest:
                break
            bits, smallest = fewer, cost
        return bits, smallest

    def _spill_direct(self, record: _Record, payload: torch.Tensor, smallest: int, why: str) -> None:
        """Write a record that cannot fit in the pool straight from the caller's payload to disk (it takes no
        page). ``OutOfBudget`` when even its side table cannot stay in memory or the disk cannot take it;
        nothing has changed then."""
        asked = smallest + record.side_bytes
        if self._side + self._loading + record.side_bytes > self.budget:
            raise OutOfBudget(record.site, asked, self.budget, self._used,
                              f"{why}; its exception side table stays in memory and does not fit either")
        record.direct = True
        try:
            self._spill_payload(record, [payload])
        except SpillError as error:
            raise OutOfBudget(record.site, asked, self.budget, self._used,
                              f"{why}; it was to go straight to disk, which could not take it: {error}") from error
        self.counters["direct_spills"] += 1

    def _can_demote(self, record: _Record) -> bool:
        """Whether halving the record's bits (not below min_bits) would free at least one page."""
        header = record.header
        floor = self._floor(header)
        if self._reencode_with is None or header.bits <= floor:
            return False
        fewer = payload_bytes(header.numel, max(floor, header.bits // 2), header.group_size)
        return self._cost(fewer) < self._cost(record.nbytes)

    def _floor(self, packed: Packed) -> int:
        """The fewest bits demotion takes ``packed`` to: ``min_bits`` in the record's own width (a norm input
        split by a ReLU mask holds codes at twice the width the policy gave it: ``Packed.width_scale``)."""
        return min(8, self.min_bits * packed.width_scale)

    def _reencode(self, packed: Packed) -> Packed:
        started = time.perf_counter()
        bits = max(self._floor(packed), packed.bits // 2)
        self.counters["demotions"] += 1
        seed = zlib.crc32(struct.pack("<QQ", self._seed, self.counters["demotions"]))
        demoted = self._reencode_with(packed, bits, seed)
        self.counters["demoted_bytes_saved"] += packed.nbytes - demoted.nbytes
        self.seconds["demote_seconds"] += time.perf_counter() - started
        return demoted

    def _demote(self, record: _Record) -> None:
        demoted = self._reencode(_with_payload(record.header, self._gather(record)))
        self._unplace(record)
        self._side -= record.side_bytes
        self._payload -= record.nbytes
        record.header, record.nbytes = self._header(demoted), demoted.payload.nbytes
        self._side += record.side_bytes
        self._payload += record.nbytes
        self._place(record, _payload_bytes(demoted))

    def _spill_out(self, record: _Record) -> None:
        pool = self._pools[record.device]
        self._spill_payload(record, pool.views(record.pages, record.nbytes))
        self._unplace(record)

    def _spill_payload(self, record: _Record, segments: list[torch.Tensor]) -> None:
        started = time.perf_counter()
        record.spilled = self._spill.write(record.ref, segments, record.site)
        self.seconds["spill_write_seconds"] += time.perf_counter() - started
        record.awaited = True
        if not record.direct:  # a direct one is read back when backward is about to ask for it
            self._spilled.add(record)
        self.counters["spills"] += 1
        self.counters["spilled_bytes"] += record.nbytes

    # -- prefetch --------------------------------------------------------------------------
    def _schedule_prefetch(self) -> None:
        """Start reading spilled records back, next needed first, while they fit in the budget; then the
        next record backward will ask for if it went straight to disk."""
        while len(self._spilled) and self._worker is not None:
            record = self._spilled.least()
            if self._used + self._cost(record.nbytes) > self.budget:
                break
            self._spilled.remove(record)
            self._start_read(record, into_pool=True)
        if self._worker is not None:
            self._read_back_direct()

    def _read_back_direct(self) -> None:
        """Start reading the next record backward needs if it went straight to disk: into the pool if it
        fits now, else into a buffer outside the pool, one at a time (so at most one record's payload is
        held outside the budget, only from when backward has asked for the record before it)."""
        record = self._unasked.least()
        if record is None or not record.direct or record.loading is not None or record.failure is not None:
            return
        into_pool = self._used + self._cost(record.nbytes) <= self.budget
        if into_pool or self._staged_bytes == 0:
            self._start_read(record, into_pool)

    def _start_read(self, record: _Record, into_pool: bool) -> None:
        """Hand the worker one spilled record to read into pages reserved now, or into a buffer outside the pool."""
        if into_pool:
            pool = self._pool(record.device)
            record.pages = pool.allocate(pool.pages_for(record.nbytes))
            self._loading += len(record.pages) * self.page_size
            segments = pool.views(record.pages, record.nbytes)
        else:
            record.staged = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)
            self._staged_bytes += record.nbytes
            self.counters["staged_reads"] += 1
            segments = [record.staged]
        try:
            record.loading = self._worker.submit(self._load, record, segments)
        except RuntimeError:  # the interpreter is exiting (releases from garbage collection): no more threads
            self._worker = None  # from now on a get reads the file itself
            self._cancel_read(record)
            return
        self.counters["prefetches"] += 1

    def _cancel_read(self, record: _Record) -> None:
        """Undo ``_start_read`` for a read the worker never got: the record is spilled as before."""
        if record.pages is not None:
            self._loading -= len(record.pages) * self.page_size
        else:
            self.counters["staged_reads"] -= 1
        self._drop_copy(record)
        if not record.direct:
            self._spilled.add(record)

    def _load(self, record: _Record, segments: list[torch.Tensor]) -> None:
        """Worker thread: read one spilled record into the pages or the buffer reserved for it."""
        failure = None
        try:
            self._spill.read_into(record.spilled, segments, record.site)
        except SpillError as caught:  # its message goes to whoever asks for the record
            failure = str(caught)
        except BaseException as caught:
            failure = (f"DAF could not read back spilled activation {record.site!r} from "
                       f"{record.spilled.path!r}: {type(caught).__name__}: {caught}")
        with self._locked():
            record.loading = None
            if record.pages is not None:
                self._loading -= len(record.pages) * self.page_size
            if record.released or failure is not None:
                record.failure = failure
                self._drop_copy(record)
                if record.released:
                    self._spill.remove(record.spilled)
                return
            self._spill.remove(record.spilled)
            record.spilled, record.direct = None, False
            if record.pages is not None:
                self._index_resident(record)

    def _drop_copy(self, record: _Record) -> None:
        """Free what a read back was filling (pages or the buffer outside the pool); the file stays."""
        if record.pages is not None:
            self._pools[record.device].free(record.pages)
            record.pages = record.view = None
        if record.staged is not None:
            self._staged_bytes -= record.staged.numel()
            record.staged = None

    # -- release, figures, close -----------------------------------------------------------
    def _release_now(self, ref: int) -> None:
        record = self._records.pop(ref, None)
        if record is None:
            return
        record.released = True
        self._side -= record.side_bytes
        self._payload -= record.nbytes
        if self.budget is not None:
            self._unasked.discard(record)
        if record.loading is not None:
            return  # the worker frees its pages and file when the read finishes
        if record.pages is not None:
            self._unplace(record)
        self._drop_copy(record)
        if record.spilled is not None:
            self._spilled.discard(record)
            self._spill.remove(record.spilled)
        if self._in_backward and self._worker is not None:
            self._schedule_prefetch()
        self._free_when_closed_and_empty()

    def stats(self) -> dict[str, Any]:
        """Figures for ``daf.report``'s "store" section (bytes unless named otherwise)."""
        with self._locked():
            reserved = sum(p.reserved_bytes for p in self._pools.values())
            pages_in_use = sum(p.in_use_bytes for p in self._pools.values())
            resident_payload = sum(r.nbytes for r in self._records.values() if r.pages is not None)
            figures: dict[str, Any] = {
                "store": "paged", "records": len(self._records), "bytes_in_use": self._used,
                "high_water_bytes": self._high_water, "payload_bytes": self._payload, "page_size": self.page_size,
                "pool_reserved_bytes": reserved, "pool_in_use_bytes": pages_in_use,
                "pool_high_water_bytes": sum(p.high_water_pages * p.page_size for p in self._pools.values()),
                "pool_chunks": sum(p.chunks for p in self._pools.values()),
                "pool_growths": sum(p.growths for p in self._pools.values()),
                "internal_fragmentation": 1 - resident_payload / pages_in_use if pages_in_use else 0.0,
            }
            if self.budget is not None:
                on_disk = sum(r.spilled is not None and r.loading is None for r in self._records.values())
                figures.update(budget=self.budget, min_bits=self.min_bits, **self.counters,
                               spilled_now=on_disk, staged_bytes=self._staged_bytes, **self.seconds)
            return figures

    def close(self) -> None:
        """Stop the prefetch worker and refuse further puts (``StoreClosed``). Idempotent.

        Records already put stay readable until released, because backward may run after the model is
        unwrapped (a spilled one is then read at its ``get``). The pool's memory and the spill directory
        go with the last release, or now if nothing is left.
        """
        with self._locked():
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)  # outside the lock: a read in flight takes it to finish
        with self._locked():
            self._free_when_closed_and_empty()

    @property
    def closed(self) -> bool:
        return self._closed

    def _free_when_closed_and_empty(self) -> None:
        """Once closed and empty: give back every pool's memory and remove the spill directory."""
        if not self._closed or self._records:
            return
        self._pools.clear()
        self._side = self._payload = self._loading = self._staged_bytes = 0
        if self._spill is not None:
            self._spill.close()

    def _check(self) -> None:
        """Assert every invariant of the store, its pools and indexes. O(records + pages)."""
        with self._locked():
            for index in (self._resident, self._demotable, self._spilled, self._unasked):
                index._check()
            used, payload, side, loading, staged = 0, 0, 0, 0, 0
            for ref, record in self._records.items():
                assert record.ref == ref and not record.released
                state = (record.pages is not None, record.spilled is not None, record.loading is not None)
                # resident, spilled, loading into the pool, loading outside it, read back outside it
                assert state in ((True, False, False), (False, True, False), (True, True, True), (False, True, True),
                                 (False, False, False)) or record.failure is not None, (ref, state)
                assert (record.staged is not None) == (state in ((False, True, True), (False, False, False))), ref
                assert not record.direct or record.spilled is not None, ref
                resident = state == (True, False, False)
                indexed = resident and self.budget is not None  # without a budget nothing is indexed
                assert (record in self._resident) == indexed
                assert (record in self._demotable) == (indexed and self._can_demote(record))
                assert (record in self._spilled) == (
                    state == (False, True, False) and record.failure is None and not record.direct)
                assert record.view is None or (record.pages is not None and record.view.numel() == record.nbytes)
                if record.pages is not None:
                    assert len(record.pages) == -(-record.nbytes // self.page_size)
                    used += len(record.pages) * self.page_size
                    if record.loading is not None:
                        loading += len(record.pages) * self.page_size
                if record.staged is not None:
                    assert record.staged.numel() == record.nbytes
                    staged += record.nbytes
                side += record.side_bytes
                payload += record.nbytes
            assert len(self._resident) + len(self._spilled) <= len(self._records)
            assert all(self._records.get(r.ref) is r for r in self._unasked)
            held_outside = sum(r.staged is not None for r in self._records.values())
            # one buffer outside the pool at a time (a released record being read may hold it until the read ends)
            assert held_outside <= 1 and self._staged_bytes >= 0
            assert held_outside == 0 or staged == self._staged_bytes, (staged, self._staged_bytes)
            loading_elsewhere = sum(p.in_use_bytes for p in self._pools.values()) - sum(
                len(r.pages) * self.page_size for r in self._records.values() if r.pages is not None)
            assert loading_elsewhere >= 0  # released records still being read hold pages until the read ends
            assert used + side + loading_elsewhere == self._used, (used, side, loading_elsewhere, self._used)
            assert loading + loading_elsewhere == self._loading, (loading, loading_elsewhere, self._loading)
            assert payload == self._payload and side == self._side
            if self.budget is not None:
                assert self._used <= self.budget, (self._used, self.budget)
            for pool in self._pools.values():
                pool._check()
