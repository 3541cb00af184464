"""The decoded-tensor cache: a small decode beside the last large one does not evict it; records' deaths drop theirs."""

import gc

import torch

from daf.runtime.recent import SMALL, RecentDecodes


class Record:
    """Stands for a stored record (weakly referenced by the cache)."""


def test_a_small_decode_does_not_evict_the_large_one():
    cache, large, small = RecentDecodes(), Record(), Record()
    big = torch.zeros(1024)
    cache.put(large, big)
    little = torch.zeros(int(1024 * SMALL))
    cache.put(small, little)
    assert cache.get(large) is big and cache.get(small) is little and len(cache) == 2


def test_a_decode_above_the_small_fraction_takes_the_large_slot_and_drops_both():
    cache, first, small, second = RecentDecodes(), Record(), Record(), Record()
    cache.put(first, torch.zeros(1024))
    cache.put(small, torch.zeros(8))
    cache.put(second, torch.zeros(int(1024 * SMALL) + 1))
    assert cache.get(first) is None and cache.get(small) is None and cache.get(second) is not None
    assert len(cache) == 1


def test_a_record_that_dies_takes_its_tensor_with_it():
    cache, large, small = RecentDecodes(), Record(), Record()
    cache.put(large, torch.zeros(1024))
    cache.put(small, torch.zeros(4))
    del large
    gc.collect()
    assert len(cache) == 1 and cache.get(small) is not None
    del small
    gc.collect()
    assert len(cache) == 0


def test_a_record_of_equal_bytes_is_not_mistaken_for_another():
    cache, a, b = RecentDecodes(), Record(), Record()
    cache.put(a, torch.ones(16))
    assert cache.get(b) is None
    cache.clear()
    assert cache.get(a) is None and len(cache) == 0


def test_threads_never_get_another_records_tensor():
    """Backward may unpack on several threads (two backward calls at once): whatever the interleaving, a
    record gets its own decoded tensor or none, never another's. Decodes are torch ops (the GIL released)."""
    import threading

    cache, failures = RecentDecodes(), []
    records = [Record() for _ in range(8)]
    tensors = [torch.full((256 if i % 2 else 8,), float(i)) for i in range(8)]

    def work(offset: int) -> None:
        for step in range(3000):
            i = (step * 3 + offset) % 8
            cache.put(records[i], tensors[i] + 0)  # a fresh tensor: an op that releases the GIL
            j = (step + offset) % 8
            got = cache.get(records[j])
            if got is not None and float(got[0]) != j:
                failures.append((j, float(got[0])))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
