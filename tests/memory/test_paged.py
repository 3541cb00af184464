"""The paged store: exact round trips, the budget's order (demote, spill, refuse), prefetch, invariants."""

import errno
import random
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import daf
from daf.codec import MinMaxCodec, Spec
from daf.config import Config
from daf.format import payload_bytes
from daf.memory import OutOfBudget, PagedStore, SpillError, make_store
from daf.memory import spill as spill_module

PAGE = 4096
_REENCODE = MinMaxCodec(Config()).reencode  # what the session hands the store


def _packed(numel: int, bits: int, seed: int = 0, codec: MinMaxCodec | None = None):
    codec = codec or MinMaxCodec(Config(backend="reference"))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return codec.encode(x, Spec(bits, seed))


def _same(a, b) -> bool:
    return (torch.equal(a.payload, b.payload) and a.shape == b.shape and a.bits == b.bits
            and a.dtype == b.dtype and a.order == b.order and a.group_size == b.group_size)


def _cost(packed) -> int:
    return -(-packed.payload.nbytes // PAGE) * PAGE


def _spill_files(store: PagedStore) -> list[str]:
    """The record files in the store's spill directory (beside them: the directory's marker)."""
    directory = store._spill.directory
    return [] if directory is None or not Path(directory).exists() else [p.name for p in Path(directory).glob("*.bin")]


def _wait_for_reads(store: PagedStore) -> None:
    store._worker.submit(lambda: None).result()  # the single worker runs reads in order
    with store._locked():
        pass


def test_make_store_picks_the_paged_store_with_and_without_a_budget():
    assert isinstance(make_store(Config(budget="1MiB"), _REENCODE), PagedStore)
    store = make_store(Config(), _REENCODE)
    assert isinstance(store, PagedStore) and store._worker is None and store._spill is None


def test_round_trip_without_budget_keeps_everything_exact_including_exceptions():
    store = PagedStore(Config(page_size=PAGE))
    x = torch.randn(5000)
    x[[3, 4000]] = torch.tensor([float("nan"), float("inf")])
    originals = [MinMaxCodec(Config()).encode(x, Spec(2, 1))] + [_packed(n, b, n) for n, b in ((4096, 1), (30000, 8), (999, 4))]
    assert originals[0].exc_index is not None
    refs = [store.put(p, float(i), f"s#{i}") for i, p in enumerate(originals)]
    store._check()
    for ref, original in zip(refs, originals):
        back = store.get(ref)
        assert _same(back, original)
        assert torch.equal(back.exc_index if back.exc_index is not None else torch.empty(0),
                           original.exc_index if original.exc_index is not None else torch.empty(0))
    for ref in refs:
        store.release(ref)
        store._check()
    assert store.stats()["records"] == 0 and store.stats()["pool_in_use_bytes"] == 0


def test_spill_round_trip_through_the_store_is_bit_exact():
    originals = [_packed(8192 + 512 * i, 2, i) for i in range(12)]
    budget = 3 * _cost(originals[0])
    store = PagedStore(Config(page_size=PAGE, budget=budget, min_bits=2), _REENCODE)
    refs = [store.put(p, float(i), f"s#{i}") for i, p in enumerate(originals)]
    store._check()
    stats = store.stats()
    assert stats["spills"] >= 9 and stats["demotions"] == 0 and stats["high_water_bytes"] <= budget
    for ref, original in reversed(list(zip(refs, originals))):  # backward order
        assert _same(store.get(ref), original)
        store.release(ref)
        store._check()
    stats = store.stats()
    assert stats["prefetch_hits"] + stats["prefetch_misses"] == stats["spills"]
    assert stats["prefetches"] > 0 and stats["records"] == 0
    assert not _spill_files(store)
    store.close()


def test_demotion_goes_first_least_important_first_down_to_min_bits():
    codec = MinMaxCodec(Config())
    originals = [_packed(16384, 8, i) for i in range(4)]
    eight, four = _cost(originals[0]), _cost(_packed(16384, 4))
    store = PagedStore(Config(page_size=PAGE, budget=3 * eight + four, min_bits=2), codec.reencode)
    refs = [store.put(p, float(i), f"s#{i}") for i, p in enumerate(originals)]
    store._check()
    bits = [store.get(r).bits for r in refs]
    assert bits == [4, 8, 8, 8]  # one halving of the least important record makes room
    assert store.stats()["spills"] == 0 and store.stats()["demotions"] == 1
    x = codec.decode(originals[0])
    demoted = codec.decode(store.get(refs[0]))
    step = (x.max() - x.min()) / 15
    assert (demoted - x).abs().max() <= 1.01 * step  # a 4-bit code of the same values
    more = [store.put(_packed(16384, 8, 10 + i), 10.0 + i, f"t#{i}") for i in range(3)]
    store._check()
    assert [store.get(r).bits for r in refs] == [2, 2, 2, 2] or store.stats()["spills"] > 0
    assert all(store.get(r).bits >= 2 for r in refs + more)


def _with_nan(numel: int, seed: int = 0):
    """A 2-bit record with a one-element exception side table (12 B that stay in memory)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[3] = float("nan")
    return MinMaxCodec(Config(backend="reference")).encode(x, Spec(2, seed))


def _full_disk(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_record_as_large_as_the_budget_goes_straight_to_disk_and_is_read_back_exact_when_next_needed():
    """The reported case: codes that take exactly the budget's pages, beside another record's 12 B of
    exceptions, with nothing on disk. Before, put raised OutOfBudget."""
    big = _packed(60000, 2, 1)
    budget = _cost(big)
    store = PagedStore(Config(page_size=PAGE, budget=budget, min_bits=2), _REENCODE)
    small, after = _with_nan(5000), _packed(500, 2, 2)
    refs = [store.put(small, 0.0, "small#0"), store.put(big, 1.0, "big#0"), store.put(after, 2.0, "after#0")]
    store._check()
    record = store._records[refs[1]]
    assert record.direct and record.pages is None and record.spilled.nbytes == big.payload.nbytes
    stats = store.stats()
    assert stats["direct_spills"] == 1 and stats["spills"] == 1 and stats["demotions"] == 0
    assert stats["high_water_bytes"] <= budget and stats["pool_high_water_bytes"] < budget  # it never took a page
    assert _same(store.get(refs[2]), after)  # backward begins: big is next, read into a buffer outside the pool
    _wait_for_reads(store)
    store._check()
    assert store.stats()["staged_bytes"] == big.payload.nbytes and record.spilled is None  # its file is gone
    assert _same(store.get(refs[1]), big) and store.stats()["prefetch_hits"] == 1
    for ref in reversed(refs):
        store.release(ref)
        store._check()
    stats = store.stats()
    assert stats["staged_reads"] == 1 and stats["staged_bytes"] == 0 and stats["records"] == 0
    assert not _spill_files(store)
    store.close()


def test_a_record_written_straight_to_disk_comes_back_into_the_pool_when_it_fits_by_then():
    big = _packed(60000, 2, 1)
    x = torch.randn(5000)
    x[:400] = float("nan")  # 4800 B of exceptions: more than a page that cannot leave memory
    small, after = MinMaxCodec(Config()).encode(x, Spec(2, 0)), _packed(500, 2, 2)
    store = PagedStore(Config(page_size=PAGE, budget=_cost(big) + PAGE, min_bits=2), _REENCODE)
    refs = [store.put(small, 0.0, "small#0"), store.put(big, 1.0, "big#0"), store.put(after, 2.0, "after#0")]
    assert store._records[refs[1]].direct
    store.release(refs[0])  # its side table goes (a saved tensor backward does not use)
    assert _same(store.get(refs[2]), after)  # backward begins: big is next and fits in the pool now
    _wait_for_reads(store)
    store._check()
    record = store._records[refs[1]]
    assert record.pages is not None and not record.direct and store.stats()["staged_reads"] == 0
    assert _same(store.get(refs[1]), big) and store.stats()["prefetch_hits"] == 1
    for ref in refs[1:]:
        store.release(ref)
    store._check()


def test_a_record_larger_than_the_budget_is_read_at_get_when_the_worker_has_not_brought_it():
    originals = [_packed(60000, 2, i) for i in range(3)]  # each larger than the budget
    store = PagedStore(Config(page_size=PAGE, budget=2 * PAGE, min_bits=2), _REENCODE)
    refs = [store.put(p, float(i), f"s#{i}") for i, p in enumerate(originals)]
    for ref, original in zip(refs, originals):  # out of backward order: only the next needed is read ahead
        assert _same(store.get(ref), original)
        store._check()
    _wait_for_reads(store)
    stats = store.stats()
    assert stats["direct_spills"] == 3 and stats["prefetch_hits"] + stats["prefetch_misses"] == 3
    assert stats["staged_bytes"] <= originals[0].payload.nbytes  # one buffer outside the pool at most
    for ref in refs:
        store.release(ref)
    _wait_for_reads(store)
    store._check()
    assert store.stats()["staged_bytes"] == 0 and not _spill_files(store)


def test_a_record_larger_than_the_budget_raises_out_of_budget_when_the_disk_cannot_take_it(monkeypatch):
    store = PagedStore(Config(page_size=PAGE, budget=4 * PAGE, min_bits=1), _REENCODE)
    kept = _packed(4096, 8, 0)
    ref = store.put(kept, 0.0, "small#0")
    monkeypatch.setattr(spill_module, "_write_all", _full_disk)
    with pytest.raises(daf.OutOfBudget) as caught:
        store.put(_packed(200_000, 2, 1), 1.0, "huge#0")
    message = str(caught.value)
    asked = -(-payload_bytes(200_000, 1, 256) // PAGE) * PAGE  # what it takes at its fewest bits
    assert f"({asked} B)" in message and f"({4 * PAGE} B)" in message and "huge#0" in message
    assert "straight to disk" in message and "no space left" in message
    assert caught.value.asked == asked and caught.value.budget == 4 * PAGE and caught.value.in_use == _cost(kept)
    assert isinstance(caught.value, MemoryError) and daf.OutOfBudget is OutOfBudget
    assert isinstance(caught.value.__cause__, SpillError)
    stats = store.stats()  # nothing has changed
    assert stats["demotions"] == stats["spills"] == stats["direct_spills"] == 0 and stats["records"] == 1
    assert _same(store.get(ref), kept) and not _spill_files(store)
    store._check()


def test_a_record_whose_exception_side_table_alone_passes_the_budget_raises_out_of_budget():
    x = torch.full((5000,), float("nan"))  # 5000 exceptions: a side table larger than the budget
    packed = MinMaxCodec(Config()).encode(x, Spec(2, 0))
    store = PagedStore(Config(page_size=PAGE, budget=4 * PAGE, min_bits=2), _REENCODE)
    with pytest.raises(daf.OutOfBudget, match=r"side table stays in memory"):
        store.put(packed, 0.0, "nan#0")
    assert store.stats()["spills"] == 0 and len(store) == 0
    store._check()


def test_an_incoming_record_less_important_than_the_rest_is_the_one_spilled():
    originals = [_packed(8192, 2, i) for i in range(3)]
    store = PagedStore(Config(page_size=PAGE, budget=2 * _cost(originals[0]), min_bits=2), _REENCODE)
    refs = [store.put(originals[0], 5.0, "a#0"), store.put(originals[1], 6.0, "b#0"),
            store.put(originals[2], 1.0, "c#0")]  # least important arrives last
    records = store._records
    assert records[refs[2]].spilled is not None and records[refs[0]].pages is not None
    assert _same(store.get(refs[2]), originals[2])
    store._check()


def test_corrupted_spill_file_is_detected_on_the_way_back(tmp_path):
    originals = [_packed(8192, 2, i) for i in range(4)]
    store = PagedStore(Config(page_size=PAGE, budget=_cost(originals[0]), min_bits=2, spill_dir=str(tmp_path)),
                       _REENCODE)
    refs = [store.put(p, float(i), f"block{i}#0") for i, p in enumerate(originals)]
    for record in store._records.values():
        if record.spilled is not None:
            path = Path(record.spilled.path)
            path.write_bytes(b"\xff" + path.read_bytes()[1:])
    assert _same(store.get(refs[3]), originals[3])  # resident
    store.release(refs[3])  # room: the worker prefetches block2 and finds it corrupted
    with pytest.raises(SpillError, match=r"block2#0.*corrupted"):
        store.get(refs[2])
    with pytest.raises(SpillError, match=r"block1#0.*corrupted"):
        store.get(refs[1])
    for ref in refs[:3]:
        store.release(ref)
    _wait_for_reads(store)
    store._check()
    assert not _spill_files(store)


def test_release_while_a_read_is_in_flight_frees_everything_when_it_ends():
    originals = [_packed(65536, 2, i) for i in range(6)]
    store = PagedStore(Config(page_size=PAGE, budget=2 * _cost(originals[0]), min_bits=2), _REENCODE)
    refs = [store.put(p, float(i), f"s#{i}") for i, p in enumerate(originals)]
    store.get(refs[5])
    for ref in refs:
        store.release(ref)
    _wait_for_reads(store)
    store._check()
    stats = store.stats()
    assert stats["records"] == 0 and stats["bytes_in_use"] == 0 and stats["pool_in_use_bytes"] == 0


def test_stats_carry_the_pool_and_budget_figures():
    store = PagedStore(Config(page_size=PAGE, budget="1MiB"), _REENCODE)
    ref = store.put(_packed(5000, 2), 0.0, "a#0")
    stats = store.stats()
    for key in ("pool_reserved_bytes", "pool_in_use_bytes", "internal_fragmentation", "demotions", "spills",
                "prefetch_hits", "prefetch_misses", "spill_wait_seconds", "budget"):
        assert key in stats
    assert stats["pool_in_use_bytes"] == PAGE and 0 < stats["internal_fragmentation"] < 1
    store.release(ref)


def test_small_stress_reserved_stays_within_five_percent_of_the_high_water_mark():
    """The small version of benchmarks/pool_stress.py: random shapes and bits, step after step."""
    rng = random.Random(0)
    store = PagedStore(Config(page_size=PAGE))
    payload_high_water = live = 0
    for step in range(80):
        refs = []
        for i in range(rng.randrange(6, 24)):
            numel = int(2 ** rng.uniform(13, 18))  # 8K .. 256K elements
            bits = rng.choice((1, 2, 4, 8))
            payload = torch.empty(payload_bytes(numel, bits, 256), dtype=torch.uint8)
            payload[::997] = step % 256
            packed = daf.format.Packed(payload, (numel,), (0,), torch.float32, bits, 256)
            refs.append((store.put(packed, float(i), "stress"), packed))
            live += payload.numel()
            payload_high_water = max(payload_high_water, live)
        if step % 10 == 0:
            store._check()
        for ref, packed in reversed(refs):
            if ref % 7 == 0:
                assert torch.equal(store.get(ref).payload, packed.payload)
            store.release(ref)
            live -= packed.payload.numel()
    store._check()
    stats = store.stats()
    assert stats["pool_reserved_bytes"] <= 1.05 * stats["pool_high_water_bytes"]
    assert stats["pool_reserved_bytes"] <= 1.05 * payload_high_water
    assert stats["pool_chunks"] == 1


class BudgetMachine(RuleBasedStateMachine):
    """Hypothesis drives put/get/release under a tight budget (spill only): every get is bit-exact.

    Sizes go past the budget (27 KB against 24 KB: straight to disk), some records carry exception side
    tables, backward takes every record in reverse order, and a put may meet a full disk: then it either
    fits without the disk or raises (OutOfBudget, or SpillError when a victim could not be written) and
    stores nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.store = PagedStore(Config(page_size=PAGE, budget=6 * PAGE, min_bits=2), _REENCODE)
        self.live: dict[int, object] = {}
        self.seq = 0

    def _new(self, numel: int, exceptions: bool):
        self.seq += 1
        return _with_nan(numel, self.seq) if exceptions else _packed(numel, 2, self.seq)

    @rule(numel=st.sampled_from([256, 4096, 9000, 20000, 100_000]), importance=st.floats(-10, 10),
          exceptions=st.booleans())
    def put(self, numel, importance, exceptions):
        packed = self._new(numel, exceptions)
        self.live[self.store.put(packed, importance, f"s#{self.seq}")] = packed

    @rule(numel=st.sampled_from([4096, 20000, 100_000]), importance=st.floats(-10, 10))
    def put_on_a_full_disk(self, numel, importance):
        packed, before = self._new(numel, False), len(self.store)
        with mock.patch.object(spill_module, "_write_all", _full_disk):
            try:
                self.live[self.store.put(packed, importance, f"s#{self.seq}")] = packed
            except (OutOfBudget, SpillError):
                assert len(self.store) == before

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 100))
    def get(self, which):
        ref = sorted(self.live)[which % len(self.live)]
        assert _same(self.store.get(ref), self.live[ref])

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 100))
    def release(self, which):
        ref = sorted(self.live)[which % len(self.live)]
        del self.live[ref]
        self.store.release(ref)

    @precondition(lambda self: self.live)
    @rule()
    def backward(self):
        for ref in sorted(self.live, reverse=True):
            assert _same(self.store.get(ref), self.live.pop(ref))
            self.store.release(ref)

    @invariant()
    def consistent(self):
        self.store._check()
        assert self.store.stats()["staged_bytes"] <= payload_bytes(100_000, 2, 256)  # one record outside the pool

    def teardown(self):
        self.store.close()


TestBudgetMachine = BudgetMachine.TestCase
TestBudgetMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_release_from_inside_the_store_waits_for_the_lock_instead_of_deadlocking():
    store = PagedStore(Config(page_size=PAGE))
    ref = store.put(_packed(5000, 2), 0.0, "a#0")
    with store._locked():  # as when garbage collection runs a _Saved.__del__ inside the store
        store.release(ref)
        assert len(store) == 1
    assert len(store) == 0
    with pytest.raises(KeyError, match="not stored"):
        store.get(ref)
    store._check()


@pytest.mark.parametrize("return_pages", [False, True])
def test_the_config_says_whether_freed_pages_go_back(return_pages):
    store = PagedStore(Config(page_size=PAGE, return_pages=return_pages))
    ref = store.put(_packed(20000, 4), 1.0, "s")
    assert store._pools[torch.device("cpu")].return_pages is return_pages
    store.release(ref)
    assert Config().return_pages is False  # the default: no fault per page in the next forward


def test_returning_pages_off_the_cpu_says_it_does_nothing():
    store = PagedStore(Config(page_size=PAGE, return_pages=True))
    with pytest.warns(UserWarning, match="CPU only; the page pool on meta keeps them"):
        store._pool(torch.device("meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store._pool(torch.device("cpu"))
        PagedStore(Config(page_size=PAGE))._pool(torch.device("meta"))  # not asked for: nothing to say
