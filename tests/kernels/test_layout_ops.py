"""Channels-last output on the kernels (``daf.kernels.layout_ops`` and ``format1_decode_into`` into a
channels-last tensor) against the plain-PyTorch statements, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.codec.backends import ReferenceBackend
from daf.kernels import layout_ops, ops, reference
from daf.kernels.build import HEADERS, SOURCE_DIR

DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd
BIT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}


def bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.view(BIT_VIEW[x.dtype]) if x.dtype in BIT_VIEW else x


def reference_copy(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.daf.channels_last_copy.default._op_dk(DEFAULT, x)


def test_every_header_is_hashed_into_the_build():
    """A header missing from HEADERS would leave a stale library after an edit."""
    assert set(HEADERS) == {p.name for p in SOURCE_DIR.glob("*.h")}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3), c=st.integers(1, 70), h=st.integers(1, 9), w=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                              torch.uint8, torch.bool]))
def test_kernel_copy_equals_pytorchs_channels_last_copy(extension, n, c, h, w, dtype):
    x = (torch.randn(n, c, h, w) * 100).to(dtype)
    if dtype.is_floating_point and x.numel():
        x.view(-1)[0] = float("nan")  # moved bitwise, never converted
    want = x.contiguous(memory_format=torch.channels_last)
    for got in (layout_ops.channels_last_copy(x), reference_copy(x)):
        assert got.is_contiguous(memory_format=torch.channels_last) and got.shape == x.shape
        assert torch.equal(bits_of(got).contiguous(), bits_of(want).contiguous())
        assert got.data_ptr() != x.data_ptr() or x.numel() == 0


@pytest.mark.parametrize("shape", [(2, 48, 5, 7), (1, 16, 4, 4), (3, 33, 17, 1), (2, 64, 28, 28)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float32, torch.bfloat16, torch.int16])
def test_kernel_copy_of_whole_and_partial_blocks(extension, shape, dtype):
    """Every element distinct (bytes: modulo 256; int16: modulo 65536), so a misplaced one shows: 16 x 16
    byte blocks, 8 x 8 half-word and word blocks, with the rows and columns they leave."""
    x = torch.arange(torch.Size(shape).numel()).view(shape)
    x = (x % 2 == 0) if dtype == torch.bool else (x % 256 if dtype == torch.uint8 else x).to(dtype)
    assert torch.equal(layout_ops.channels_last_copy(x), x.contiguous(memory_format=torch.channels_last))


def test_copy_takes_any_layout_and_refuses_other_ranks(extension):
    x = torch.randn(2, 5, 3, 4).transpose(2, 3)  # neither contiguous nor channels-last
    assert torch.equal(layout_ops.channels_last_copy(x), x)
    already = torch.randn(2, 5, 3, 4).contiguous(memory_format=torch.channels_last)
    assert layout_ops.to_channels_last(already) is already
    assert layout_ops.channels_last_copy(already).data_ptr() != already.data_ptr()
    with pytest.raises(ValueError, match="4-D tensor"):
        layout_ops.channels_last_copy(torch.randn(3, 4, 5))


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (37, 70), (512, 576), (64, 1530)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_transposed_is_a_contiguous_copy_of_the_transpose(extension, shape, dtype):
    m = torch.arange(shape[0] * shape[1]).view(shape)
    m = (m % 256 if dtype == torch.uint8 else m).to(dtype)
    got = layout_ops.transposed(m)
    assert got.is_contiguous() and torch.equal(got, m.t()) and got.data_ptr() != m.data_ptr()
    assert torch.equal(layout_ops.transposed(m.t()), m)  # from a non-contiguous view
    with pytest.raises(ValueError, match="2-D tensor"):
        layout_ops.transposed(m.view(1, *shape))


def test_copy_has_shapes_on_the_meta_device():
    out = layout_ops.channels_last_copy(torch.empty(2, 3, 4, 5, device="meta"))
    assert out.shape == (2, 3, 4, 5) and out.is_contiguous(memory_format=torch.channels_last)


SHAPES = [(3, 64, 4, 4), (2, 16, 5, 5), (4, 3, 7, 3), (1, 1, 1, 1), (5, 2, 1, 1), (2, 9, 16, 32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [8, 64, 256])
def test_decode_into_channels_last_equals_decode_then_copy(extension, shape, bits, dtype, group_size):
    """One pass where each image starts a group (c*h*w % group_size == 0), decode and copy elsewhere:
    the values of the flat decode in NCHW order, bit for bit, either way."""
    x = (torch.randn(shape) * 50).to(dtype)
    payload, _, _ = ops.encode_flat(x.reshape(-1), bits, group_size, True, 11)
    flat = reference.decode_flat(payload, x.numel(), bits, group_size, dtype)
    want = flat.view(shape).contiguous(memory_format=torch.channels_last)
    out = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)
    ops.decode_into(payload, bits, group_size, out)
    assert torch.equal(bits_of(out), bits_of(want))
    reference_out = ReferenceBackend().decode_into(payload, bits, group_size, torch.empty_like(out))
    assert torch.equal(bits_of(reference_out), bits_of(want))


def test_decode_into_channels_last_keeps_exceptional_values(extension):
    x = torch.randn(2, 8, 4, 4)
    x[1, 3, 2, 1], x[0, 0, 0, 0] = float("inf"), float("nan")
    payload, exc_index, exc_value = ops.encode_flat(x.reshape(-1), 2, 64, True, 3)
    assert exc_index is not None
    out = torch.empty(x.shape, memory_format=torch.channels_last)
    ops.decode_into(payload, 2, 64, out, exc_index, exc_value)
    want = reference.decode_flat(payload, x.numel(), 2, 64, torch.float32, exc_index, exc_value).view(x.shape)
    assert torch.equal(bits_of(out.contiguous()), bits_of(want))
    assert out[1, 3, 2, 1] == float("inf") and out[0, 0, 0, 0].isnan()


def test_half_values_stay_finite_in_channels_last(extension):
    """The decode clamps to half's range before the cast, in the one-pass path too."""
    x = torch.full((2, 64, 2, 2), 65504.0, dtype=torch.float16)
    x[:, :, 0, 0] = -65504.0
    payload, _, _ = ops.encode_flat(x.reshape(-1), 2, 256, True, 5)
    out = torch.empty(x.shape, dtype=torch.float16, memory_format=torch.channels_last)
    ops.decode_into(payload, 2, 256, out)
    assert out.isfinite().all()
