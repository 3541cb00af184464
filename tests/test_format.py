import pytest
import torch

from daf.format import flatten_memory_order, num_groups, payload_bytes, restore_memory_order, row_bytes


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("group_size", [16, 256, 4096])
def test_row_is_metadata_plus_whole_bytes_of_codes(bits, group_size):
    assert row_bytes(bits, group_size) == 4 + group_size * bits // 8
    assert payload_bytes(group_size * 3 + 1, bits, group_size) == 4 * row_bytes(bits, group_size)
    assert num_groups(0, group_size) == 0


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 4, 5),
    lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    lambda: torch.randn(6, 7).t(),
    lambda: torch.randn(4, 6)[:, ::2],
    lambda: torch.randn(3, 1, 5).transpose(0, 2),
    lambda: torch.randn(5).expand(3, 5),
    lambda: torch.tensor(3.0),
])
def test_memory_order_round_trip_keeps_values_and_dense_strides(make):
    x = make()
    flat, order = flatten_memory_order(x)
    assert flat.dim() == 1 and flat.is_contiguous()
    back = restore_memory_order(flat.clone(), tuple(x.shape), order)
    assert torch.equal(back, x)
    dense = x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last) or x.stride() == (1, 7)
    if dense:
        assert back.stride() == x.stride()


def test_channels_last_is_read_without_copy():
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    flat, _ = flatten_memory_order(x)
    assert flat.data_ptr() == x.data_ptr()
