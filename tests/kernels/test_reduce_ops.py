"""The column magnitudes (``daf.kernels.reduce_ops``): the C++ kernel against the plain-PyTorch statement."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.kernels import reduce_ops

DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3e38, -3e38]


def reference(m: torch.Tensor) -> torch.Tensor:
    return torch.ops.daf.column_absmax.default._op_dk(DEFAULT, m)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_column_absmax_has_a_default_and_a_cpu_kernel(extension):
    assert reduce_ops.native_registered()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("daf::column_absmax", "CompositeExplicitAutograd")


@settings(max_examples=120, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(0, 700), seed=st.integers(0, 2**16), special=st.floats(0, 0.3))
def test_kernel_is_the_reference(extension, rows, cols, seed, special):
    """Across the kernel's 256-column blocks and threads; NaN, infinities, signed zeros and denormals."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=g) * 10
    pick = torch.rand(rows, cols, generator=g) < special
    m[pick] = torch.tensor(SPECIAL)[torch.randint(len(SPECIAL), (int(pick.sum()),), generator=g)]
    got, want = reduce_ops.column_absmax(m), reference(m)
    assert got.dtype == torch.float32 and got.shape == (cols,)
    assert same(got, want)
    if cols:
        assert same(want, m.abs().amax(0))  # the statement itself, for the record


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(600, 5000), cols=st.integers(1, 300), threads=st.sampled_from([2, 3, 5]),
       seed=st.integers(0, 2**16), special=st.floats(0, 0.01))
def test_tall_narrow_matrices_cut_into_row_chunks_are_the_reference(extension, rows, cols, threads, seed, special):
    """Fewer column blocks than threads: the rows are cut into chunks whose maxima are combined after; a
    NaN or the largest value in any chunk, with chunks that do not divide the rows."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=g)
    pick = torch.rand(rows, cols, generator=g) < special
    m[pick] = torch.tensor(SPECIAL)[torch.randint(len(SPECIAL), (int(pick.sum()),), generator=g)]
    m[int(torch.randint(rows, (1,), generator=g))] *= 1e4  # the largest values in one row of some chunk
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = reduce_ops.column_absmax(m)
    finally:
        torch.set_num_threads(before)
    assert same(got, reference(m))


@pytest.mark.parametrize("shape", [(512, 1536), (1520, 512), (3, 100_000), (47616, 32), (3968, 384)])
def test_the_shapes_the_outliers_codec_reduces(extension, shape):
    m = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    m[-1, -1] = float("nan")  # the last element of the last block
    m[0, 0] = -1e30
    got = reduce_ops.column_absmax(m)
    assert same(got, reference(m)) and got[0] == 1e30 and got[-1].isnan()


def test_other_dtypes_and_layouts_take_the_reference(extension):
    m = torch.randn(64, 48)
    for x in (m.to(torch.bfloat16), m.to(torch.float64), m.t()):  # not float32 contiguous
        got = reduce_ops.column_absmax(x)
        assert got.dtype == x.dtype and same(got, reference(x))


def test_bad_input_is_refused_by_name(extension):
    for op in (reduce_ops.column_absmax, reference):
        with pytest.raises(ValueError, match="2-D floating-point tensor with at least one row"):
            op(torch.zeros(5))
        with pytest.raises(ValueError, match="at least one row"):
            op(torch.zeros(0, 5))
        with pytest.raises(ValueError, match="floating-point"):
            op(torch.zeros(2, 5, dtype=torch.int32))
