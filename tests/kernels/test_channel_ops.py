"""The Outliers codec's split and join (``daf.kernels.channel_ops``): the C++ kernels against the
plain-PyTorch statement, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.kernels import channel_ops

DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -3e38]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def split_reference(m, inliers):
    return torch.ops.daf.channel_split.default._op_dk(DEFAULT, m, inliers)


def join_reference(coded, scale, inliers, outliers, values):
    return torch.ops.daf.channel_join.default._op_dk(DEFAULT, coded, scale, inliers, outliers, values)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns: equal bits, not equal values (NaN's payload and -0.0 count)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def matrix(rows: int, cols: int, seed: int, special: float, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 10
    pick = torch.rand(rows, cols, generator=g) < special
    m[pick] = torch.tensor(SPECIAL)[torch.randint(len(SPECIAL), (int(pick.sum()),), generator=g)]
    m[torch.rand(rows, generator=g) < special] = 0.0  # whole rows of zeros: scale 1
    return m.to(dtype)


def split_of(cols: int, outliers: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inliers, outliers): ascending, disjoint, covering range(cols)."""
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    out = perm[:outliers].sort().values
    keep = torch.ones(cols, dtype=torch.bool)
    keep[out] = False
    return keep.nonzero().flatten(), out


def test_the_ops_have_a_default_and_a_cpu_kernel(extension):
    assert channel_ops.native_registered()
    for op in ("daf::channel_split", "daf::channel_join", "daf::channel_decode_join"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeExplicitAutograd")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 100), cols=st.integers(1, 300), outliers=st.integers(0, 8), seed=st.integers(0, 2**16),
       special=st.sampled_from([0.0, 0.01, 0.3]), dtype=st.sampled_from(DTYPES))
def test_split_and_join_are_the_reference_bit_for_bit(extension, rows, cols, outliers, seed, special, dtype):
    """Across the kernels' 32-token blocks and threads; NaN, infinities, signed zeros, denormals, rows of
    zeros; float16 and bfloat16 saves; no outliers and all but none."""
    m = matrix(rows, cols, seed, special, dtype)
    inliers, out = split_of(cols, min(outliers, cols), seed)
    coded, scale = channel_ops.channel_split(m, inliers)
    want_coded, want_scale = split_reference(m, inliers)
    assert coded.dtype == scale.dtype == torch.float32 and coded.shape == (inliers.numel(), rows)
    assert torch.equal(bits(scale), bits(want_scale)) and torch.equal(bits(coded), bits(want_coded))
    values = m.index_select(1, out)
    restored = channel_ops.channel_join(coded, scale, inliers, out, values)
    want = join_reference(coded, scale, inliers, out, values)
    assert restored.dtype == dtype and restored.shape == (rows, cols)
    assert torch.equal(bits(restored), bits(want))
    # the outliers come back exactly (a narrow NaN may come back as another NaN, in the statement too)
    torch.testing.assert_close(restored[:, out], values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(2048, 384), (512, 1536), (3, 5000)])
def test_the_shapes_of_the_workloads(extension, shape):
    m = matrix(*shape, seed=sum(shape), special=0.001, dtype=torch.float32)
    inliers, out = split_of(shape[1], max(1, shape[1] // 100), 0)
    coded, scale = channel_ops.channel_split(m, inliers)
    want_coded, want_scale = split_reference(m, inliers)
    assert torch.equal(bits(coded), bits(want_coded)) and torch.equal(bits(scale), bits(want_scale))
    values = m.index_select(1, out)
    assert torch.equal(bits(channel_ops.channel_join(coded, scale, inliers, out, values)),
                       bits(join_reference(coded, scale, inliers, out, values)))


def test_a_strided_save_and_float64_take_the_right_path(extension):
    m = torch.randn(40, 64)
    inliers, _ = split_of(64, 2, 1)
    for x in (m.t().contiguous().t(), m.double()):
        coded, scale = channel_ops.channel_split(x, inliers)
        want_coded, want_scale = split_reference(x, inliers)
        assert torch.equal(coded, want_coded) and torch.equal(scale, want_scale)


def test_fake_shapes(extension):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        m, inliers, outliers = torch.empty(10, 7), torch.empty(5, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
        coded, scale = channel_ops.channel_split(m, inliers)
        assert coded.shape == (5, 10) and scale.shape == (10,)
        out = channel_ops.channel_join(coded, scale, inliers, outliers, torch.empty(10, 2, dtype=torch.bfloat16))
        assert out.shape == (10, 7) and out.dtype == torch.bfloat16


def test_bad_input_is_refused_by_name(extension):
    m, inliers = torch.randn(4, 6), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="2-D floating-point m"):
        channel_ops.channel_split(m.reshape(-1), inliers)
    with pytest.raises(ValueError, match="int64 inliers"):
        channel_ops.channel_split(m, inliers.int())
    with pytest.raises(ValueError, match=r"channel numbers in \[0, 6\)"):
        channel_ops.channel_split(m, torch.tensor([0, 9]))
    coded, scale = channel_ops.channel_split(m, inliers)
    with pytest.raises(ValueError, match="each of 6 channels once"):
        channel_ops.channel_join(coded, scale, inliers, torch.tensor([3, 4]), torch.randn(4, 2))
    with pytest.raises(ValueError, match="float32 coded"):
        channel_ops.channel_join(coded.double(), scale, inliers, torch.tensor([4, 5]), torch.randn(4, 2))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_opcheck(extension, dtype):
    """Schema, autograd registration, fake tensors and AOT dispatch with dynamic shapes."""
    m = matrix(70, 40, seed=3, special=0.0, dtype=dtype)
    inliers, outliers = split_of(40, 2, 3)
    torch.library.opcheck(torch.ops.daf.channel_split.default, (m, inliers))
    coded, scale = channel_ops.channel_split(m, inliers)
    torch.library.opcheck(torch.ops.daf.channel_join.default, (coded, scale, inliers, outliers, m.index_select(1, outliers)))


def decode_join_reference(payload, bits_, group_size, scale, inliers, outliers, values):
    return torch.ops.daf.channel_decode_join.default._op_dk(DEFAULT, payload, bits_, group_size, scale, inliers,
                                                            outliers, values)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 400), cols=st.integers(2, 200), outliers=st.integers(0, 6), width=st.sampled_from([1, 2, 4, 8]),
       group=st.sampled_from([8, 16, 32, 64, 128, 256]), stochastic=st.booleans(), seed=st.integers(0, 2**16),
       special=st.sampled_from([0.0, 0.01]))
def test_decode_join_is_decode_then_join_bit_for_bit(extension, rows, cols, outliers, width, group, stochastic, seed,
                                                     special):
    """Tokens that are and are not a multiple of 8 (the kernel's condition), groups shorter and longer than its
    64-token blocks and not aligned with a channel's tokens, every width, rows of zeros and outliers' NaN."""
    if group * width % 8:
        group = 8
    m = matrix(rows, cols, seed, special, torch.float32)
    inliers, out = split_of(cols, min(outliers, cols - 1), seed)
    coded, scale = channel_ops.channel_split(m, inliers)
    payload, ok = torch.ops.daf.format1_encode(coded.nan_to_num(0.0, 0.0, 0.0), width, group, stochastic, seed)
    values = m.index_select(1, out)
    restored = channel_ops.channel_decode_join(payload, width, group, scale, inliers, out, values)
    want = decode_join_reference(payload, width, group, scale, inliers, out, values)
    assert restored.dtype == torch.float32 and restored.shape == (rows, cols)
    assert torch.equal(bits(restored), bits(want))


def test_decode_join_at_the_workloads_shapes_and_its_checks(extension):
    for rows, cols in ((1984, 384), (3968, 1536), (512, 576)):
        m = matrix(rows, cols, seed=rows, special=0.0, dtype=torch.float32)
        inliers, out = split_of(cols, max(1, cols // 100), 0)
        coded, scale = channel_ops.channel_split(m, inliers)
        payload, _ = torch.ops.daf.format1_encode(coded, 4, 128, False, 7)
        values = m.index_select(1, out)
        args = (payload, 4, 128, scale, inliers, out, values)
        assert torch.equal(bits(channel_ops.channel_decode_join(*args)), bits(decode_join_reference(*args)))
    with pytest.raises(ValueError, match="each of .* channels once"):
        channel_ops.channel_decode_join(payload, 4, 128, scale, inliers, out.clamp(max=0), values)
    with pytest.raises(ValueError, match="payload must be uint8"):
        channel_ops.channel_decode_join(payload[:-1], 4, 128, scale, inliers, out, values)
    torch.library.opcheck(torch.ops.daf.channel_decode_join.default, (payload, 4, 128, scale, inliers, out, values))
