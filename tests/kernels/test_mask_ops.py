"""The mask ops (``daf.kernels.mask_ops``): C++ kernels against the plain-PyTorch reference, byte for byte."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.codec import mask
from daf.codec.nonzeros import nonzeros_of, scatter_nonzeros
from daf.kernels import mask_ops, mask_reference
from daf.kernels.mask_reference import INT_VIEW
from daf.codec.minmax import encode as minmax_encode
from daf.kernels import reference as format_reference

DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SPECIAL = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 1.0, -1.0]
# Across the kernels' work units (8192 elements), threads, and the reference's 1M-element slices.
LARGE = [8192 * 3 + 5, (1 << 20) + 13]


def default(name, *args):
    """The reference implementation, called through the dispatcher under its own key."""
    return getattr(torch.ops.daf, name).default._op_dk(DEFAULT, *args)


def native(name, *args):
    return getattr(torch.ops.daf, name)(*args)


def floats(n, dtype, seed, special=0.2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    pick = torch.rand(n, generator=g) < special
    x[pick] = torch.tensor(SPECIAL)[torch.randint(len(SPECIAL), (int(pick.sum()),), generator=g)]
    return x.to(dtype)


def torch_bits(bits: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch packing (no numpy): the statement both implementations must match."""
    return mask_reference.pack_slice_torch(bits) if bits.numel() else torch.empty(0, dtype=torch.uint8)


def test_mask_ops_have_a_default_and_a_cpu_kernel(extension):
    assert mask_ops.native_registered()
    for name in mask_ops.MASK_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"daf::{name}", "CompositeExplicitAutograd")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"daf::{name}", "CPU")


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 3000), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16),
       special=st.floats(0, 1))
def test_relu_mask_encode_is_the_reference(extension, n, dtype, seed, special):
    x = floats(n, dtype, seed, special)
    expected = torch_bits((x <= 0).logical_not())
    assert torch.equal(native("relu_mask_encode", x), expected)
    assert torch.equal(default("relu_mask_encode", x), expected)
    assert torch.equal(native("mask_unpack", expected, n), (x <= 0).logical_not())
    assert torch.equal(default("mask_unpack", expected, n), (x <= 0).logical_not())


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), dtype=st.sampled_from([*FLOATS, torch.bool]), seed=st.integers(0, 2**16),
       two=st.booleans())
def test_mask_encode_and_select_are_the_reference_bitwise(extension, n, dtype, seed, two):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        x = torch.rand(n, generator=g) < 0.5
    elif two:  # two values by their bits: -0.0 and NaN included
        pair = torch.tensor(SPECIAL)[torch.randperm(len(SPECIAL), generator=g)[:2]].to(dtype)
        x = pair[(torch.rand(n, generator=g) < 0.5).long()]
    else:
        x = floats(n, dtype, seed)
    codes = x.view(mask_reference.INT_VIEW[dtype])
    expected = torch_bits(codes != codes[0])
    assert torch.equal(native("mask_encode", x), expected)
    assert torch.equal(default("mask_encode", x), expected)
    values = x[[0, int((codes != codes[0]).long().argmax())]].clone()
    ints = mask_reference.INT_VIEW[dtype]
    for select in (native, default):
        got = select("mask_select", expected, n, values)
        assert got.dtype == dtype and torch.equal(got.view(ints), values.view(ints)[(codes != codes[0]).long()])


@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 3000), dtype=st.sampled_from([*FLOATS, torch.bool]), seed=st.integers(0, 2**16),
       kinds=st.integers(1, 3), at=st.floats(0, 1))
def test_mask_second_is_the_reference(extension, n, dtype, seed, kinds, at):
    """Where the second bit pattern is, or -1 for a third: native and reference (in short slices, so that
    their edges are crossed) agree, and both agree with a count of the distinct patterns."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        pool = torch.tensor([True, False])
    else:
        pool = torch.tensor(SPECIAL)[torch.randperm(len(SPECIAL), generator=g)[:3]].to(dtype)
    x = pool[:1].expand(n).clone()
    if kinds >= 2 and n > 1:
        x[torch.rand(n, generator=g) < 0.5] = pool[1]
    if kinds == 3 and n > 1 and dtype != torch.bool:
        x[min(n - 1, int(at * n))] = pool[2]  # one third value anywhere: first, middle, past a slice, last
    codes = x.view(INT_VIEW[dtype])
    distinct = len(set(codes.tolist()))
    expected = -1 if distinct > 2 else (0 if distinct == 1 else int((codes != codes[0]).long().argmax()))
    assert native("mask_second", x).item() == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mask_reference, "CHUNK", 64)
        patch.setattr(mask_reference, "SAMPLE", 16)
        assert default("mask_second", x).item() == expected


@pytest.mark.parametrize("n", LARGE)
def test_mask_second_across_units_and_threads(extension, n):
    x = (torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5).float() * 2.0
    x[0] = 0.0
    where = int((x != 0).long().argmax())
    assert native("mask_second", x).item() == where == default("mask_second", x).item()
    for third_at in (where + 1, n // 2, n - 1):  # a third value just after the second, mid-way, last
        y = x.clone()
        y[third_at] = 3.0
        assert native("mask_second", y).item() == -1 == default("mask_second", y).item()


def test_mask_second_refuses_what_cannot_be_a_mask(extension):
    for op in (native, default):
        with pytest.raises(ValueError, match="non-empty"):
            op("mask_second", torch.empty(0))
        with pytest.raises(ValueError, match="non-empty"):
            op("mask_second", torch.zeros(4, dtype=torch.int32))
        with pytest.raises(ValueError, match="flat"):
            op("mask_second", torch.zeros(2, 2))


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(0, 5), st.integers(1, 40), st.integers(1, 9), st.integers(1, 9)),
       dtype=st.sampled_from([*FLOATS, torch.bool]), seed=st.integers(0, 2**16))
def test_mask_select_channels_last_is_mask_select_in_that_layout(extension, shape, dtype, seed):
    """Images whose bits start mid-byte (c * h * w not a multiple of 8) take the reference on the CPU too."""
    g = torch.Generator().manual_seed(seed)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    bits = torch_bits(torch.rand(numel, generator=g) < 0.5)
    values = torch.tensor([True, False]) if dtype == torch.bool else torch.tensor([-0.0, 2.5], dtype=dtype)
    expected = default("mask_select", bits, numel, values).view(shape)
    for select in (native, default):
        got = select("mask_select_channels_last", bits, list(shape), values)
        assert got.is_contiguous(memory_format=torch.channels_last) and got.dtype == dtype and got.shape == shape
        assert torch.equal(got.view(mask_reference.INT_VIEW[dtype]) if dtype != torch.bool else got,
                           expected.view(mask_reference.INT_VIEW[dtype]) if dtype != torch.bool else expected)


def test_mask_select_channels_last_on_a_resnet_stage_and_bad_shapes(extension):
    shape = [9, 64, 28, 28]  # several images per thread; the bytes of SSE2 blocks and of the edges
    numel = 9 * 64 * 28 * 28
    bits = torch_bits(torch.rand(numel, generator=torch.Generator().manual_seed(0)) < 0.5)
    values = torch.tensor([False, True])
    got = native("mask_select_channels_last", bits, shape, values)
    assert torch.equal(got, native("mask_unpack", bits, numel).view(shape))
    assert got.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="4-D"):
        native("mask_select_channels_last", bits, [numel], values)
    with pytest.raises(ValueError, match="bits must be uint8"):
        native("mask_select_channels_last", bits[:-1], shape, values)


@pytest.mark.parametrize("n", LARGE)
@pytest.mark.parametrize("dtype", FLOATS)
def test_large_tensors_across_units_threads_and_slices(extension, n, dtype):
    x = floats(n, dtype, n)
    bits = native("relu_mask_encode", x)
    assert torch.equal(bits, default("relu_mask_encode", x))
    assert torch.equal(native("mask_unpack", bits, n), default("mask_unpack", bits, n))
    values = torch.tensor([2.5, -0.0], dtype=dtype)
    assert torch.equal(native("mask_select", bits, n, values).view(torch.uint8),
                       default("mask_select", bits, n, values).view(torch.uint8))
    relu = x.nan_to_num(0.0).relu()
    got, expected = native("relu_nonzeros", relu), default("relu_nonzeros", relu)
    assert bool(got[1]) and bool(expected[1]) and torch.equal(got[0], expected[0])
    relu_bits = native("relu_mask_encode", relu)
    assert torch.equal(native("mask_scatter", got[0], relu_bits, n), default("mask_scatter", got[0], relu_bits, n))
    assert torch.equal(native("mask_scatter", got[0], relu_bits, n), relu)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 3000), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16),
       zeros=st.floats(0, 1), refuse=st.sampled_from([None, -1.0, float("nan"), -float("nan"), -float("inf")]))
def test_nonzeros_and_scatter_are_the_reference(extension, n, dtype, seed, zeros, refuse):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) * 4
    x[torch.rand(n, generator=g) < zeros] = 0.0
    x[torch.rand(n, generator=g) < 0.1] = -0.0
    x[torch.rand(n, generator=g) < 0.01] = float("inf")
    x = x.to(dtype)
    if refuse is not None and n:
        x[int(torch.randint(n, (1,), generator=g))] = refuse
    (values, ok), (expected, expected_ok) = native("relu_nonzeros", x), default("relu_nonzeros", x)
    assert bool(ok) == bool(expected_ok) == (refuse is None or n == 0)
    assert values.dtype == dtype and torch.equal(values, expected)
    if not ok:
        assert values.numel() == 0
        return
    assert torch.equal(values, x[x > 0])
    bits = native("relu_mask_encode", x)
    for scatter in (native, default):
        out = scatter("mask_scatter", values, bits, n)
        assert torch.equal(out, torch.where(x > 0, x, torch.zeros_like(x)))
        assert not bool(torch.signbit(out).any())  # zeros come back as +0


@pytest.mark.parametrize("scatter", [native, default])
def test_scatter_refuses_a_mask_that_disagrees(extension, scatter):
    x = torch.rand(1001).relu()
    x[::3] = 0
    bits = native("relu_mask_encode", x)
    values = x[x > 0]
    with pytest.raises(ValueError, match="set bits for"):
        scatter("mask_scatter", values[1:], bits, 1001)
    flipped = bits.clone()
    flipped[0] ^= 1
    with pytest.raises(ValueError, match="set bits for"):
        scatter("mask_scatter", values, flipped, 1001)
    padded = bits.clone()
    padded[-1] |= 0x80  # element 1007, past the end: padding bits count for nothing
    assert torch.equal(scatter("mask_scatter", values, padded, 1001), x)
    assert torch.equal(scatter("mask_unpack", padded, 1001), x > 0)


def test_bad_arguments_are_refused_everywhere(extension):
    for op in (native, default):
        with pytest.raises(ValueError, match="floating point"):
            op("relu_mask_encode", torch.ones(4, dtype=torch.int32))
        with pytest.raises(ValueError, match="flat"):
            op("relu_mask_encode", torch.ones(2, 2))
        with pytest.raises(ValueError, match="bits must be uint8"):
            op("mask_unpack", torch.zeros(1, dtype=torch.uint8), 9)
        with pytest.raises(ValueError, match="values must be"):
            op("mask_select", torch.zeros(1, dtype=torch.uint8), 8, torch.zeros(3))


def test_codec_masks_keep_shape_and_strides_on_the_kernels(extension):
    x = torch.randn(2, 3, 5, 7).relu().to(memory_format=torch.channels_last)
    x[0, 0, 0, :2] = torch.tensor([-0.0, float("nan")])
    packed = mask.encode_relu_mask(x)
    flat = x.permute(0, 2, 3, 1).reshape(-1)
    assert torch.equal(packed.payload, torch_bits((flat <= 0).logical_not()))
    decoded = mask.decode_relu_mask(packed)
    assert decoded.dtype == x.dtype and decoded.stride() == x.stride()
    assert torch.equal(decoded, (x <= 0).logical_not().to(x.dtype))
    clean = x.nan_to_num(0.0)
    nonzeros = nonzeros_of(clean, 1)
    rebuilt = scatter_nonzeros(nonzeros, mask.encode_relu_mask(clean), "site")
    assert rebuilt.stride() == x.stride() and torch.equal(rebuilt, clean)
    assert nonzeros_of(x, 1) is None  # the NaN: not where a mask can say
    with pytest.raises(RuntimeError, match="site s1 .* refusing to return wrong data"):
        scatter_nonzeros(nonzeros[1:], mask.encode_relu_mask(clean), "s1")


def _nonzeros_record(n: int, zeros: float, bits: int, group_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) * 4
    x[torch.rand(n, generator=g) < zeros] = 0.0
    values = x[x > 0]
    payload, _ = torch.ops.daf.format1_encode(values, bits, group_size, True, seed)
    return x, values, payload, native("relu_mask_encode", x)


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(0, 3000), st.sampled_from(LARGE[:1])), zeros=st.floats(0, 1),
       bits=st.sampled_from([1, 2, 4, 8]), group_size=st.sampled_from([8, 64, 256, 1024]), seed=st.integers(0, 2**16))
def test_nonzeros_decode_scatter_is_decode_then_scatter(extension, n, zeros, bits, group_size, seed):
    x, values, payload, bits_of_x = _nonzeros_record(n, zeros, bits, group_size, seed)
    decoded = torch.ops.daf.format1_decode(payload, values.numel(), bits, group_size, torch.float32)
    expected = native("mask_scatter", decoded, bits_of_x, n)
    for run in (native, default):
        got = run("nonzeros_decode_scatter", payload, values.numel(), bits, group_size, bits_of_x, n)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(expected == 0, x == 0)


@pytest.mark.parametrize("run", [native, default])
def test_nonzeros_decode_scatter_refuses_a_mask_that_disagrees(extension, run):
    x, values, payload, bits_of_x = _nonzeros_record(1000, 0.5, 2, 256, 0)
    other = native("relu_mask_encode", torch.roll(x, 1) * (torch.arange(1000) > 0))
    if int(native("mask_unpack", other, 1000).sum()) != values.numel():
        with pytest.raises(ValueError, match="set bits for"):
            run("nonzeros_decode_scatter", payload, values.numel(), 2, 256, other, 1000)
    with pytest.raises(ValueError, match="payload must be uint8"):
        run("nonzeros_decode_scatter", payload[1:], values.numel(), 2, 256, bits_of_x, 1000)


def test_decode_nonzeros_is_one_op_for_float32_and_decode_then_scatter_otherwise(extension):
    from daf.codec.nonzeros import decode_nonzeros
    from daf.codec.minmax import encode as minmax_encode, decode as minmax_decode

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 8, 9, 9).relu().to(dtype).to(memory_format=torch.channels_last)
        x[0, 1, 2, 3] = float("inf")  # kept exactly in the record's exception table: decoded, then scattered
        relu = mask.encode_relu_mask(x)
        nonzeros = nonzeros_of(x, 1)
        packed = minmax_encode(nonzeros, bits=2, seed=3)
        expected = scatter_nonzeros(minmax_decode(packed), relu, "s")
        assert packed.exc_index is not None and packed.exc_index.numel() == 1
        got = decode_nonzeros(packed, relu, "s", minmax_decode)
        assert got.dtype == dtype and got.stride() == x.stride() and torch.equal(got, expected)
        clean = minmax_encode(nonzeros.clamp(max=1e3), bits=2, seed=3)  # no exceptions: the one-op path
        assert torch.equal(decode_nonzeros(clean, relu, "s", minmax_decode),
                           scatter_nonzeros(minmax_decode(clean), relu, "s"))
    short = minmax_encode(nonzeros_of(x, 1)[1:].float(), bits=2)
    with pytest.raises(RuntimeError, match="site s7 .* refusing to return wrong data"):
        decode_nonzeros(short, mask.encode_relu_mask(x.float()), "s7", minmax_decode)


@settings(max_examples=80, deadline=None)
@given(n=st.one_of(st.integers(0, 3000), st.sampled_from(LARGE[:1])), dtype=st.sampled_from(FLOATS),
       seed=st.integers(0, 2**16), kept=st.floats(0, 1))
def test_split_by_mask_is_the_reference(extension, n, dtype, seed, kept):
    """A norm's input split by its ReLU mask (daf.codec.split): the kernel gives the reference's bytes."""
    x = floats(n, dtype, seed)
    keep = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) < kept
    bits = torch_bits(keep)
    for run in (native, default):
        got_kept, got_others = run("split_by_mask", x, bits)
        assert torch.equal(got_kept.view(INT_VIEW[dtype]), x[keep].view(INT_VIEW[dtype]))
        assert torch.equal(got_others.view(INT_VIEW[dtype]), x[~keep].view(INT_VIEW[dtype]))


@pytest.mark.parametrize("run", [native, default])
def test_split_by_mask_refuses_bad_arguments(extension, run):
    with pytest.raises(ValueError, match="bits must be uint8"):
        run("split_by_mask", torch.ones(1001), torch.tensor([0x55] * 125, dtype=torch.uint8))
    with pytest.raises(ValueError, match="flat"):
        run("split_by_mask", torch.ones(10, 100), torch.tensor([0x55] * 125, dtype=torch.uint8))


@settings(max_examples=60, deadline=None)
@given(n=st.one_of(st.integers(0, 3000), st.sampled_from(LARGE[:1])), kept=st.floats(0, 1),
       bits=st.sampled_from([1, 2, 4, 8]), group_size=st.sampled_from([16, 64, 256]), seed=st.integers(0, 2**16))
def test_split_decode_is_decode_then_join(extension, n, kept, bits, group_size, seed):
    """A split record in one pass: the codes decoded where the bit is set, each other element its run's mean."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, generator=g) < kept
    count = int(keep.sum())
    payload = minmax_encode(torch.randn(count, generator=g), bits=bits, group_size=group_size).payload.reshape(-1)
    others = n - count
    means = torch.randn(-(-others // group_size), generator=g)
    expected = torch.empty(n)
    expected[keep] = format_reference.decode_flat(payload, count, bits, group_size, torch.float32, None, None)
    expected[~keep] = means.repeat_interleave(group_size)[:others]
    mask_bits = torch_bits(keep)
    for run in (native, default):
        assert torch.equal(run("split_decode", payload, count, bits, group_size, means, mask_bits, n), expected)


@pytest.mark.parametrize("run", [native, default])
def test_split_decode_refuses_a_mask_that_disagrees_and_bad_means(extension, run):
    bits = torch.tensor([0x55] * 125, dtype=torch.uint8)  # 500 set of 1000
    payload = minmax_encode(torch.randn(499), bits=4, group_size=256).payload.reshape(-1)
    with pytest.raises(ValueError, match="the mask has 500 set bits for 499 values"):
        run("split_decode", payload, 499, 4, 256, torch.zeros(2), bits, 1000)
    with pytest.raises(ValueError, match=r"means must be float32 \[2\]"):
        run("split_decode", payload, 499, 4, 256, torch.zeros(3), bits, 1000)


def test_fake_shapes(extension):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1001)
        assert torch.ops.daf.relu_mask_encode(x).shape == (126,)
        assert torch.ops.daf.mask_unpack(torch.empty(126, dtype=torch.uint8), 1001).dtype == torch.bool
        assert torch.ops.daf.mask_select(torch.empty(126, dtype=torch.uint8), 1001, torch.empty(2,
                                         dtype=torch.float16)).dtype == torch.float16


@pytest.mark.parametrize("name, args", [
    ("relu_mask_encode", lambda: (floats(1001, torch.float32, 0),)),
    ("mask_encode", lambda: ((torch.rand(1001) < 0.5).float(),)),
    ("mask_unpack", lambda: (torch.randint(0, 256, (126,), dtype=torch.uint8), 1001)),
    ("mask_count", lambda: (torch.randint(0, 256, (126,), dtype=torch.uint8), 1001)),
    ("mask_select", lambda: (torch.randint(0, 256, (126,), dtype=torch.uint8), 1001, torch.tensor([0.5, -2.0]))),
    ("mask_scatter", lambda: (torch.ones(500), torch.tensor([0x55] * 125, dtype=torch.uint8), 1000)),
    ("relu_nonzeros", lambda: (floats(1001, torch.float32, 0, 0.0).relu(),)),  # a size that depends on the data
    ("nonzeros_decode_scatter", lambda: _nonzeros_record(1001, 0.5, 2, 256, 0)[2:3]
     + (int((_nonzeros_record(1001, 0.5, 2, 256, 0)[0] > 0).sum()), 2, 256, _nonzeros_record(1001, 0.5, 2, 256, 0)[3], 1001)),
    ("split_by_mask", lambda: (floats(1000, torch.float32, 0, 0.0), torch.tensor([0x55] * 125, dtype=torch.uint8))),
    ("split_decode", lambda: (minmax_encode(torch.randn(500), bits=4, group_size=256).payload.reshape(-1), 500, 4, 256,
                              torch.zeros(2), torch.tensor([0x55] * 125, dtype=torch.uint8), 1000)),
])
def test_opcheck(extension, name, args):
    torch.library.opcheck(getattr(torch.ops.daf, name).default, args())


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 5000), seed=st.integers(0, 2**16), density=st.floats(0, 1))
def test_mask_count_is_the_reference(extension, n, seed, density):
    """Across the kernel's words and a last byte with bits past ``n`` set (they do not count)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(n, generator=g) < density
    packed = torch_bits(bits)
    if n % 8:
        packed[-1] |= 0xFF << (n % 8) & 0xFF  # garbage past the end
    want = int(bits.sum())
    assert int(native("mask_count", packed, n)) == want
    assert int(default("mask_count", packed, n)) == want
    assert native("mask_count", packed, n).dtype == torch.int64
