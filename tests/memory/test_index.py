"""The importance index against a plain sorted list, with its invariants checked after every operation."""

import random
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from daf.memory.index import ImportanceIndex, by_importance, by_need


def _item(seq: int, importance: float) -> SimpleNamespace:
    return SimpleNamespace(seq=seq, importance=importance)


def test_seeded_random_operations_match_a_sorted_list():
    rng = random.Random(1)
    index, model = ImportanceIndex(), []
    for seq in range(800):
        if model and rng.random() < 0.4:
            item = model.pop(rng.randrange(len(model)))
            index.remove(item)
        else:
            item = _item(seq, float(rng.randrange(20)))  # many equal importances: ties go by pack order
            index.add(item)
            model.append(item)
        index._check()
        least = min(model, key=by_importance) if model else None
        assert index.least() is least
        assert len(index) == len(model)
    assert list(index) == sorted(model, key=by_importance)


def test_need_order_is_reverse_pack_order():
    index = ImportanceIndex(by_need)
    items = [_item(seq, 0.0) for seq in range(5)]
    for item in items:
        index.add(item)
    assert [i.seq for i in index] == [4, 3, 2, 1, 0]
    index.discard(items[4])
    index.discard(items[4])  # discarding twice is harmless
    assert index.least() is items[3] and items[4] not in index
    index._check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 1e6, allow_nan=False), st.booleans()), max_size=60))
def test_any_sequence_of_adds_and_removes(ops):
    index, live = ImportanceIndex(), []
    for seq, (importance, remove) in enumerate(ops):
        if remove and live:
            index.remove(live.pop(0))
        else:
            live.append(_item(seq, importance))
            index.add(live[-1])
        index._check()
    assert list(index) == sorted(live, key=by_importance)
    assert index.least() is (min(live, key=by_importance) if live else None)
