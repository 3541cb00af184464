"""The page pool: invariants under random traffic, contents, growth from demand, limit."""

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from daf.memory.pool import PagePool, PoolExhausted

PAGE = 4096


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_random_traffic_keeps_invariants_and_contents():
    rng = random.Random(0)
    pool = PagePool(PAGE, "cpu", min_growth_bytes=PAGE)
    live: dict[int, tuple[list[int], torch.Tensor]] = {}
    for op in range(600):
        if live and (rng.random() < 0.45 or len(live) > 40):
            key = rng.choice(list(live))
            pages, data = live.pop(key)
            assert torch.equal(pool.read(pages, data.numel()), data)
            pool.free(pages)
        else:
            data = _bytes(rng.choice([1, 100, PAGE, PAGE + 1, 3 * PAGE, rng.randrange(1, 20 * PAGE)]), op)
            pages = pool.allocate(pool.pages_for(data.numel()))
            pool.write(pages, data)
            live[op] = (pages, data)
        pool._check()
    for pages, data in live.values():
        assert torch.equal(pool.read(pages, data.numel()), data)


def test_freed_pages_are_reused_at_once_and_records_need_no_contiguous_space():
    pool = PagePool(PAGE, "cpu", min_growth_bytes=8 * PAGE)
    held = [pool.allocate(1) for _ in range(8)]
    for pages in held[::2]:
        pool.free(pages)  # four single free pages with gaps between them
    pool._check()
    pages = pool.allocate(4)
    assert sorted(pages) == [p for (p,) in held[::2]]  # no growth: the scattered pages serve the record
    assert pool.reserved_pages == 8 and pool.growths == 1
    data = _bytes(4 * PAGE - 7, 1)
    pool.write(pages, data)
    assert torch.equal(pool.read(pages, data.numel()), data)
    pool._check()


def test_contiguous_record_is_read_as_a_view():
    pool = PagePool(PAGE, "cpu")
    pages = pool.allocate(3)
    pool.write(pages, _bytes(3 * PAGE, 2))
    view = pool.read(pages, 3 * PAGE)
    assert view.untyped_storage().data_ptr() == pool.views(pages, 3 * PAGE)[0].untyped_storage().data_ptr()


def test_growth_follows_the_previous_steps_demand_and_compacts_to_one_chunk():
    pool = PagePool(PAGE, "cpu", min_growth_bytes=PAGE)
    step = [pool.allocate(5) for _ in range(20)]  # first step: 100 pages, several growths
    assert pool.chunks > 1
    for pages in step:
        pool.free(pages)
    assert pool.chunks == 1 and pool.last_step_high_water == 100 and pool.compactions == 1
    reserved = pool.reserved_pages
    assert 100 <= reserved <= 100 * 1.05
    step = [pool.allocate(5) for _ in range(20)]  # the same demand needs no growth
    assert pool.reserved_pages == reserved
    step.append(pool.allocate(reserved))  # a bigger step grows by at least what is missing
    assert pool.reserved_pages >= 100 + reserved
    pool._check()


def test_limit_is_never_passed():
    pool = PagePool(PAGE, "cpu", limit_bytes=10 * PAGE + 123)
    pool.allocate(7)
    with pytest.raises(PoolExhausted, match="limit is 10 pages"):
        pool.allocate(4)
    pool.allocate(3)
    assert pool.reserved_pages == 10
    pool._check()


def test_page_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        PagePool(3000, "cpu")


class PoolMachine(RuleBasedStateMachine):
    """Hypothesis drives allocate/write/free in any order; every record keeps its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(PAGE, "cpu", limit_bytes=64 * PAGE, min_growth_bytes=PAGE)
        self.live: list[tuple[list[int], torch.Tensor]] = []

    @rule(nbytes=st.integers(1, 9 * PAGE), seed=st.integers(0, 2**16))
    def store(self, nbytes, seed):
        count = self.pool.pages_for(nbytes)
        if self.pool.in_use_pages + count > 64:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(count)
            return
        pages = self.pool.allocate(count)
        data = _bytes(nbytes, seed)
        self.pool.write(pages, data)
        self.live.append((pages, data))

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 1000))
    def drop(self, which):
        pages, data = self.live.pop(which % len(self.live))
        assert torch.equal(self.pool.read(pages, data.numel()), data)
        self.pool.free(pages)

    @invariant()
    def consistent(self):
        self.pool._check()
        assert sum(len(p) for p, _ in self.live) == self.pool.in_use_pages


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


def _resident_pages(address: int, count: int) -> int | None:
    """How many of the ``count`` system pages from ``address`` are in memory (/proc/self/pagemap's present
    bit; None where it cannot be read)."""
    import mmap
    import struct

    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(address // mmap.PAGESIZE * 8)
            entries = struct.unpack(f"<{count}Q", pagemap.read(8 * count))
    except (OSError, struct.error):
        return None
    return sum(entry >> 63 for entry in entries)


@pytest.mark.parametrize("return_pages", [True, False])
def test_freed_pages_go_back_to_the_system_when_asked(return_pages):
    """With ``return_pages`` freed pages leave the process at once (RSS between steps); without it (the
    default) they stay resident for the next forward, which then writes them without faulting."""
    import mmap

    pool = PagePool(PAGE, "cpu", min_growth_bytes=64 * PAGE, return_pages=return_pages)
    pages = pool.allocate(64)
    pool.write(pages, _bytes(64 * PAGE, 1))
    address = pool.views(pages, 64 * PAGE)[0].data_ptr()
    system_pages = 64 * PAGE // mmap.PAGESIZE
    if _resident_pages(address, system_pages) != system_pages:
        pytest.skip("/proc/self/pagemap cannot be read here")
    keep, drop = pages[:16], pages[16:]
    pool.free(drop)
    if not return_pages:
        assert _resident_pages(address, system_pages) == system_pages
        return
    assert _resident_pages(address, system_pages) == 16 * PAGE // mmap.PAGESIZE
    assert not pool.read(drop, 48 * PAGE).any()  # discarded, not only unmapped (they read as fresh zeros)
    assert torch.equal(pool.read(keep, 16 * PAGE), _bytes(64 * PAGE, 1)[: 16 * PAGE])  # the rest untouched
    again = pool.allocate(48)
    pool.write(again, _bytes(48 * PAGE, 2))  # given-back pages serve again
    assert torch.equal(pool.read(again, 48 * PAGE), _bytes(48 * PAGE, 2))


def test_pages_smaller_than_the_systems_give_back_only_whole_system_pages(monkeypatch):
    """With 16 KiB system pages and 4 KiB pool pages, freeing one pool page must not clear its neighbours."""
    import mmap

    import daf.memory.pool as pool_module

    monkeypatch.setattr(pool_module.mmap, "PAGESIZE", 4 * mmap.PAGESIZE)
    pool = PagePool(PAGE, "cpu", min_growth_bytes=16 * PAGE, return_pages=True)
    pages = pool.allocate(16)
    data = _bytes(16 * PAGE, 3)
    pool.write(pages, data)
    pool.free(pages[5:6])  # inside one (pretend) system page whose other pool pages are live
    pool.free(pages[8:12])  # one whole (pretend) system page: given back
    for run in (pages[:5], pages[6:8], pages[12:]):
        first = run[0] - pages[0]
        assert torch.equal(pool.read(run, len(run) * PAGE), data[first * PAGE: (first + len(run)) * PAGE])


def test_large_chunks_give_back_whole_huge_pages_once_their_neighbours_are_free():
    """A chunk of huge pages gives back only whole huge pages (a partial one would split it, and faults
    4 KiB at a time cost 20x more): freeing a record leaves its huge page resident while a neighbour
    on it is live, and gives it back when the neighbour goes."""
    import mmap

    from daf.memory.pool import _huge_page_bytes

    huge = _huge_page_bytes()
    per_huge = huge // PAGE
    pool = PagePool(PAGE, "cpu", min_growth_bytes=4 * huge, return_pages=True)
    pages = list(pool.allocate(4 * per_huge))
    data = _bytes(4 * huge, 4)
    pool.write(pages, data)
    address = pool.views(pages, 4 * huge)[0].data_ptr()
    system_pages = 4 * huge // mmap.PAGESIZE
    if _resident_pages(address, system_pages) != system_pages:
        pytest.skip("/proc/self/pagemap cannot be read here")
    if pool._maps[0].unit != huge:
        pytest.skip("no transparent huge pages for this mapping")
    first_whole = -(-address // huge) * huge  # the first huge page boundary in the chunk
    index = (first_whole - address) // PAGE  # its pool page
    one = pages[index: index + per_huge]  # exactly one huge page
    pool.free(one[: per_huge // 2])  # half of it: nothing can go back
    assert _resident_pages(first_whole, huge // mmap.PAGESIZE) == huge // mmap.PAGESIZE
    pool.free(one[per_huge // 2:])  # the rest: the whole huge page goes back
    assert _resident_pages(first_whole, huge // mmap.PAGESIZE) == 0
    live = pages[:index] + pages[index + per_huge:]
    for run in (pages[:index], pages[index + per_huge:]):
        if run:
            first = run[0] - pages[0]
            assert torch.equal(pool.read(run, len(run) * PAGE), data[first * PAGE: (first + len(run)) * PAGE])
    pool.free(live)
