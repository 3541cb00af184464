"""The table of remade records by the value they remake (``daf.runtime.remade``)."""

from types import SimpleNamespace

import torch

from daf.runtime.remade import RemadeValues


def remake(node, records, output_nr=0):
    return SimpleNamespace(made_by=None if node is None else (node, output_nr), records=records)


def test_a_second_view_of_one_value_gets_the_first_record_and_nothing_else_does():
    table, node, other_node, x, y = RemadeValues(), object(), object(), object(), object()
    first = SimpleNamespace(records=(x,))
    tensor = torch.empty(4, 8)
    table.put(remake(node, (x,)), tensor, first)
    assert table.get(remake(node, (x,)), torch.empty(4, 8)) is first      # another view, the same value
    assert table.get(remake(node, (x,)), torch.empty(32)) is None          # another shape
    assert table.get(remake(node, (x,)), torch.empty(4, 8, dtype=torch.float64)) is None
    assert table.get(remake(node, (y,)), torch.empty(4, 8)) is None        # other records
    assert table.get(remake(node, (x,), output_nr=1), torch.empty(4, 8)) is None
    assert table.get(remake(other_node, (x,)), torch.empty(4, 8)) is None  # another node's value
    assert table.get(remake(None, (x,)), torch.empty(4, 8)) is None        # a rule that does not say
    table.clear()
    assert table.get(remake(node, (x,)), torch.empty(4, 8)) is None


def test_a_rule_that_does_not_name_the_value_is_not_kept():
    table = RemadeValues()
    table.put(remake(None, ()), torch.empty(2), SimpleNamespace(records=()))
    assert table._entries == {}
