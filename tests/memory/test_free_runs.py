"""FreeRuns against a plain set of page ids: the same pages free, lowest handed out first."""

import pytest
from hypothesis import given, settings, strategies as st

from daf.memory.free_runs import FreeRuns


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "give", "add"]), st.integers(1, 40), st.randoms()),
                max_size=60))
def test_runs_hold_the_same_pages_as_a_set_and_take_the_lowest(operations):
    free, model, taken, reserved = FreeRuns(), set(), [], 0
    for operation, count, rng in operations:
        if operation == "add":
            free.add(reserved, count)
            model.update(range(reserved, reserved + count))
            reserved += count
        elif operation == "take" and count <= len(model):
            pages = free.take(count)
            assert list(pages) == sorted(model)[:count]
            pages = list(pages)
            model.difference_update(pages)
            taken.append(pages)
        elif operation == "give" and taken:
            pages = taken.pop(rng.randrange(len(taken)))
            rng.shuffle(pages)
            free.give(pages[: len(pages) // 2])
            free.give(pages[len(pages) // 2:])
            model.update(pages)
        free._check()
        assert len(free) == len(model) and set(free) == model
        runs = free.runs()
        assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(runs, runs[1:]))  # merged


def test_a_page_freed_twice_is_refused():
    free = FreeRuns()
    free.add(0, 8)
    pages = free.take(4)
    free.give(pages)
    with pytest.raises(ValueError, match="free already"):
        free.give([2])
    with pytest.raises(ValueError, match="free already"):
        free.add(6, 4)
    with pytest.raises(ValueError, match="9 pages asked for, 8 free"):
        free.take(9)
