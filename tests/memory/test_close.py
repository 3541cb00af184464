"""The close contract: no worker left, no new put, records readable until released, memory freed at the last.

Backward may run after the model is unwrapped (its session closed), so closing cannot drop what
forward stored; it stops the prefetch worker, and the pool and the spill directory go with the
last release.
"""

import ast
import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from daf.config import Config
from daf.format import Packed, payload_bytes
from daf.memory import HeapStore, PagedStore, StoreClosed

PAGE = 4096
SRC = Path(__file__).resolve().parents[2] / "src" / "daf" / "memory"


def _packed(numel: int, seed: int) -> Packed:
    """A 2-bit record of random bytes (the store never looks inside a payload)."""
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (payload_bytes(numel, 2, 256),), dtype=torch.uint8, generator=g)
    return Packed(payload, (numel,), (0,), torch.float32, 2, 256)


def _daf_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("daf-")}


def _spilled_store(tmp_path: Path, count: int = 8) -> tuple[PagedStore, list[int], list[Packed]]:
    """A store under a budget of two records, ``count`` records put (most of them spilled)."""
    originals = [_packed(16384, i) for i in range(count)]
    budget = 2 * -(-originals[0].payload.nbytes // PAGE) * PAGE
    store = PagedStore(Config(page_size=PAGE, budget=budget, min_bits=2, spill_dir=str(tmp_path)))
    refs = [store.put(p, float(i), f"s#{i}") for i, p in enumerate(originals)]
    assert store.stats()["spills"] >= count - 2
    return store, refs, originals


def test_close_stops_the_worker_refuses_puts_and_keeps_every_record_readable_until_the_last_release(tmp_path):
    before = _daf_threads()
    store, refs, originals = _spilled_store(tmp_path)
    assert torch.equal(store.get(refs[-1]).payload, originals[-1].payload)  # backward begins
    store.release(refs.pop())  # room: the worker starts reading the next one back
    originals.pop()
    assert _daf_threads() - before
    directory = store._spill.directory
    store.close()
    assert not {t for t in _daf_threads() - before if t.is_alive()}
    with pytest.raises(StoreClosed, match=r"DAF's activation store is closed.*'late#0'"):
        store.put(_packed(100, 99), 0.0, "late#0")
    store.close()  # idempotent
    for ref, original in reversed(list(zip(refs, originals))):  # backward after the model was unwrapped
        assert store.closed and os.path.isdir(directory) and store.stats()["pool_reserved_bytes"] > 0
        assert torch.equal(store.get(ref).payload, original.payload)  # spilled ones are read at get
        store.release(ref)
        store._check()
    stats = store.stats()
    assert stats["records"] == 0 and stats["pool_reserved_bytes"] == 0 and stats["bytes_in_use"] == 0
    assert not os.path.exists(directory) and os.listdir(tmp_path) == []
    del store
    gc.collect()
    assert not {t for t in _daf_threads() - before if t.is_alive()}


def test_close_with_nothing_stored_frees_the_pool_and_the_directory_at_once(tmp_path):
    store, refs, _ = _spilled_store(tmp_path)
    store.get(refs[-1])
    for ref in refs:
        store.release(ref)
    assert os.listdir(tmp_path) and store.stats()["pool_reserved_bytes"] > 0  # kept for the next step
    store.close()
    assert os.listdir(tmp_path) == [] and store.stats()["pool_reserved_bytes"] == 0
    store.close()
    store._check()


def test_records_released_while_reads_are_in_flight_at_close_free_everything(tmp_path):
    store, refs, _ = _spilled_store(tmp_path, count=12)
    store.get(refs[-1])
    for ref in refs[:-1]:  # the worker may be reading some of them
        store.release(ref)
    store.close()
    assert os.path.isdir(store._spill.directory) and len(store) == 1
    store.release(refs[-1])
    assert os.listdir(tmp_path) == [] and store.stats()["pool_in_use_bytes"] == 0
    store._check()


def test_a_store_without_a_budget_keeps_its_records_after_close_too():
    store = PagedStore(Config(page_size=PAGE))
    original = _packed(5000, 1)
    ref = store.put(original, 0.0, "a#0")
    store.close()
    with pytest.raises(StoreClosed):
        store.put(original, 0.0, "b#0")
    assert torch.equal(store.get(ref).payload, original.payload)
    store.release(ref)
    assert store.stats()["pool_reserved_bytes"] == 0


def test_the_heap_store_keeps_the_same_contract():
    store = HeapStore()
    original = _packed(5000, 1)
    ref = store.put(original, 0.0, "a#0")
    store.close()
    store.close()
    with pytest.raises(StoreClosed, match="'b#0'"):
        store.put(original, 0.0, "b#0")
    assert store.get(ref) is original
    store.release(ref)
    assert len(store) == 0 and store.stats()["bytes_in_use"] == 0


def test_the_store_takes_a_reencode_callable_not_a_codec():
    class Codec:
        def reencode(self, packed, bits, seed):
            return packed

    with pytest.raises(TypeError, match=r"reencode must be a callable .* such as codec.reencode.*got Codec"):
        PagedStore(Config(budget="1MiB"), Codec())
    PagedStore(Config(budget="1MiB"), Codec().reencode).close()


def test_the_memory_layer_does_not_import_the_codec_or_the_runtime():
    """It demotes through the callable it is given, so the codec can change without touching it."""
    for path in SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("daf.codec", "daf.runtime", "daf.api")), (path.name, name)


def test_a_worker_that_takes_no_more_work_leaves_the_reads_to_get(tmp_path):
    """At interpreter exit executors refuse work, while garbage collection still releases records."""
    store, refs, originals = _spilled_store(tmp_path)

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    store._worker.submit = refuse
    for ref, original in reversed(list(zip(refs, originals))):
        assert torch.equal(store.get(ref).payload, original.payload)
        store.release(ref)
        store._check()
    assert store._worker is None and store.stats()["prefetches"] == 0
    store.close()
    assert os.listdir(tmp_path) == []
