"""``daf::graph_pack``, the op a compiled graph's pack hook calls: the composed ops' bytes, for every form, in
the layout inductor hands it and in one it did not predict."""

from __future__ import annotations

import pytest
import torch

import daf.kernels.graph_ops  # noqa: F401  registers torch.ops.daf.graph_pack

CHANNELS_LAST = [0, 2, 3, 1]


def _map(layout: str) -> torch.Tensor:
    x = torch.randn(4, 8, 6, 10, generator=torch.Generator().manual_seed(0)).relu()
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])  # contiguous: a wrong guess, copied
@pytest.mark.parametrize("codes, sign", [(True, False), (True, True), (False, True)])
def test_graph_pack_gives_the_composed_ops_bytes_in_the_order_asked(layout, codes, sign):
    x = _map(layout)
    flat = x.permute(CHANNELS_LAST).reshape(-1)
    payload, signs = torch.ops.daf.graph_pack(x, CHANNELS_LAST, 2, 64, codes, sign)
    expected = torch.ops.daf.format1_encode(flat, 2, 64, False, 0)[0] if codes else torch.empty(0, dtype=torch.uint8)
    assert torch.equal(payload, expected)
    assert torch.equal(signs, torch.ops.daf.relu_mask_encode(flat) if sign else torch.empty(0, dtype=torch.uint8))


def test_graph_pack_of_a_boolean_is_its_difference_bits_and_first_element():
    mask = _map("channels_last") > 0.5
    flat = mask.permute(CHANNELS_LAST).reshape(-1)
    payload, first = torch.ops.daf.graph_pack(mask, CHANNELS_LAST, 0, 256, False, False)
    assert torch.equal(payload, torch.ops.daf.mask_encode(flat)) and torch.equal(first, flat[:1])


@pytest.mark.parametrize("x, codes, sign", [(_map("channels_last"), True, True), (_map("contiguous") > 0, False, False)])
def test_opcheck(x, codes, sign):
    torch.library.opcheck(torch.ops.daf.graph_pack.default, (x, CHANNELS_LAST, 4, 64, codes, sign))


@pytest.mark.parametrize("special", [float("-inf"), float("nan"), 3e38])
def test_graph_pack_refuses_values_its_codes_cannot_keep_naming_the_save(special):
    """A graph's save has no side table: an additive mask's -inf, a NaN or a huge value would come back as a
    wrong code. The op raises with the save's name instead of handing one back."""
    x = torch.randn(4, 8, 6, 10)
    x[1, 2, 3, 4] = special
    with pytest.raises(RuntimeError, match="attn_mask_7 of a compiled graph.*cannot keep"):
        torch.ops.daf.graph_pack(x, [0, 1, 2, 3], 8, 64, True, False, "attn_mask_7")
    payload, _ = torch.ops.daf.graph_pack(x, [0, 1, 2, 3], 8, 64, False, True, "attn_mask_7")  # sign bits alone: exact
    assert payload.numel() == 0


def _relu_with_nonzeros(count: int, numel: int = 4 * 8 * 8 * 8) -> torch.Tensor:
    """A channels-last [4, 8, 8, 8] ReLU output with exactly ``count`` positives, at random places."""
    g = torch.Generator().manual_seed(count)
    flat = torch.zeros(numel)
    flat[torch.randperm(numel, generator=g)[:count]] = torch.rand(count, generator=g) * 3 + 0.01
    return flat.view(4, 8, 8, 8).permute(0, 3, 1, 2)  # memory order (0, 2, 3, 1): channels-last


@pytest.mark.parametrize("count", [0, 1, 1000, 1024, 1025, 1100, 2048])  # 1024 fit at 4 bits in 2-bit bytes
def test_graph_nonzeros_round_trip_keeps_zeros_exact_and_codes_the_nonzeros_at_the_width_that_fits(count):
    from daf.kernels.graph_ops import nonzeros_bytes, nonzeros_width
    x = _relu_with_nonzeros(count)
    payload, sign = torch.ops.daf.graph_pack_nonzeros(x, CHANNELS_LAST, 4, 2, 256)
    assert payload.numel() == nonzeros_bytes(x.numel(), 2, 256)  # fixed, whatever the count
    flat = x.permute(CHANNELS_LAST).reshape(-1)
    assert torch.equal(sign, torch.ops.daf.relu_mask_encode(flat))
    width = nonzeros_width(count, x.numel(), 4, 2, 256)
    assert width == (4 if count <= 1024 else 2)
    back = torch.ops.daf.graph_decode_nonzeros(payload, sign, x.numel(), 4, 2, 256)
    assert torch.equal(back == 0, flat == 0)  # zeros exact, nonzeros stay positive
    if count:
        values = flat[flat > 0]
        expected = torch.ops.daf.format1_decode(torch.ops.daf.format1_encode(values, width, 256, False, 0)[0],
                                                count, width, 256, torch.float32)
        assert torch.equal(back[flat > 0], expected)  # the codes' own values, bit for bit


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_graph_nonzeros_refuses_what_is_not_a_relu_output_naming_the_save(bad):
    x = _relu_with_nonzeros(100).clone()
    x[0, 0, 0, 0] = bad
    with pytest.raises(RuntimeError, match="conv7.*negative value or NaN"):
        torch.ops.daf.graph_pack_nonzeros(x, CHANNELS_LAST, 4, 2, 256, "conv7")


def test_graph_nonzeros_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        torch.ops.daf.graph_pack_nonzeros(_relu_with_nonzeros(10).bfloat16(), CHANNELS_LAST, 4, 2, 256)


def test_opcheck_nonzeros():
    x = _relu_with_nonzeros(600)
    torch.library.opcheck(torch.ops.daf.graph_pack_nonzeros.default, (x, CHANNELS_LAST, 4, 2, 256))
    payload, sign = torch.ops.daf.graph_pack_nonzeros(x, CHANNELS_LAST, 4, 2, 256)
    torch.library.opcheck(torch.ops.daf.graph_decode_nonzeros.default, (payload, sign, x.numel(), 4, 2, 256))
