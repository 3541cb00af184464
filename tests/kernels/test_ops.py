"""The ``torch.ops.daf`` op layer: registration, opcheck, fake shapes, default (reference) against CPU (C++)."""

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import daf.kernels
from daf.kernels import ops, reference
from daf.format import payload_bytes

OPS = ("format1_encode", "format1_decode", "format1_decode_into", "format1_decode_signed")
DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd


def sample(numel, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * 3 + 1).to(dtype)


def with_exceptions(numel=5000):
    x = sample(numel)
    x[[17, 300, 4000, numel - 1]] = torch.tensor([float("nan"), float("inf"), 3e38, -float("inf")])
    return x


def encode_default(*args):
    """The reference implementation, called through the dispatcher under its own key."""
    return torch.ops.daf.format1_encode.default._op_dk(DEFAULT, *args)


def test_ops_are_registered_with_a_default_and_a_cpu_kernel(extension):
    for name in OPS:
        qualname = f"daf::{name}"
        assert hasattr(torch.ops.daf, name)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")  # the fake implementation
    assert ops.native_registered()
    ops.register_native(extension)  # a second registration is a no-op, not an error


ENCODE_CASES = [
    (sample(5000), 2, 256, True, 3),
    (sample(5000), 1, 64, False, 7, ops.STRATEGIES["split_range"], True),
    (sample(70000, torch.float16), 4, 16, True, 3, ops.STRATEGIES["split_range"], False),
    (sample(3000, torch.bfloat16), 8, 4096, False, 0),
    (sample(3000, torch.float64), 2, 256, True, 1),  # the kernels do not take float64: the reference
    (sample(1000), 2, 100, True, 1),  # nor group sizes that are not powers of two
    (with_exceptions(), 4, 256, True, 3),  # ok is False, the payload is still the reference's
    (torch.empty(0), 2, 256, True, 0),
]


@pytest.mark.parametrize("args", ENCODE_CASES, ids=range(len(ENCODE_CASES)))
def test_opcheck_encode(extension, args):
    torch.library.opcheck(torch.ops.daf.format1_encode, args)


def test_opcheck_decode(extension):
    x = sample(5000)
    payload = torch.ops.daf.format1_encode(x, 2, 256, True, 3)[0]
    # Side-table values without NaN: opcheck compares eager and traced outputs with NaN != NaN.
    index, value = torch.tensor([1, 4999]), torch.tensor([float("inf"), 1e38])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        torch.library.opcheck(torch.ops.daf.format1_decode, (payload, 5000, 2, 256, dtype))
        torch.library.opcheck(torch.ops.daf.format1_decode, (payload, 5000, 2, 256, dtype, index, value))
        torch.library.opcheck(torch.ops.daf.format1_decode_into, (payload, 2, 256, None, None,
                                                                  torch.empty(5000, dtype=dtype)))
    torch.library.opcheck(torch.ops.daf.format1_decode_into, (payload, 2, 256, index, value, torch.empty(50, 100)))


def test_fake_implementations_give_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(4099, dtype=torch.bfloat16)
        payload, ok = torch.ops.daf.format1_encode(x, 2, 256, True, 0)
        assert payload.shape == (payload_bytes(4099, 2, 256),) and payload.dtype == torch.uint8
        assert ok.shape == () and ok.dtype == torch.bool
        y = torch.ops.daf.format1_decode(payload, 4099, 2, 256, torch.float16)
        assert y.shape == (4099,) and y.dtype == torch.float16
        out = torch.empty(4099)
        torch.ops.daf.format1_decode_into(payload, 2, 256, None, None, out)
        with pytest.raises(ValueError, match="bits must be one of"):
            torch.ops.daf.format1_encode(x, 3, 256, True, 0)


def test_torch_compile_traces_the_ops_without_graph_breaks(extension):
    def roundtrip(x):
        payload, _ = torch.ops.daf.format1_encode(x, 4, 256, False, 0)
        return torch.ops.daf.format1_decode(payload, x.numel(), 4, 256, x.dtype)

    x = sample(3000)
    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), roundtrip(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_default_and_cpu_implementations_agree_byte_for_byte(extension, dtype, bits):
    for numel in (1, 257, 20001):
        x = sample(numel, dtype, numel)
        for group_size in (16, 256, 4096):
            for stochastic in (False, True):
                payload, ok = torch.ops.daf.format1_encode(x, bits, group_size, stochastic, 99)
                expected, expected_ok = encode_default(x, bits, group_size, stochastic, 99)
                assert torch.equal(payload, expected) and bool(ok) and bool(expected_ok)
            values = torch.ops.daf.format1_decode(payload, numel, bits, group_size, dtype)
            assert torch.equal(values, torch.ops.daf.format1_decode.default._op_dk(
                DEFAULT, payload, numel, bits, group_size, dtype))


@settings(max_examples=30, deadline=None)
@given(numel=st.integers(1, 3000), log_group=st.integers(3, 10), bits=st.sampled_from([1, 2, 4, 8]),
       stochastic=st.booleans(), seed=st.integers(0, 2**32 - 1), strategy=st.sampled_from([0, 1]))
def test_default_and_cpu_agree_on_random_shapes(extension, numel, log_group, bits, stochastic, seed, strategy):
    x = torch.randn(numel)
    args = (x, bits, 2**log_group, stochastic, seed, strategy)
    assert torch.equal(torch.ops.daf.format1_encode(*args)[0], encode_default(*args)[0])


def test_exceptional_values_take_the_fallback_and_match_the_reference(extension):
    x = with_exceptions()
    payload, ok = torch.ops.daf.format1_encode(x, 4, 256, True, 3)
    default_payload, default_ok = encode_default(x, 4, 256, True, 3)
    expected = reference.encode_flat(x, 4, 256, True, 3)
    assert not bool(ok) and not bool(default_ok)
    assert torch.equal(payload, expected[0]) and torch.equal(default_payload, expected[0])
    got = ops.encode_flat(x, 4, 256, True, 3)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.allclose(got[2], expected[2], equal_nan=True)
    assert torch.equal(got[1], torch.tensor([17, 300, 4000, 4999]))
    decoded = ops.decode_flat(got[0], 5000, 4, 256, torch.float32, got[1], got[2])
    assert torch.allclose(decoded, reference.decode_flat(expected[0], 5000, 4, 256, torch.float32, *expected[1:]),
                          rtol=0, atol=0, equal_nan=True)


def test_exceptional_values_in_half_precision_and_the_exception_table():
    x = sample(1000, torch.float16)
    x[5] = float("inf")
    index, value = reference.exception_table(x, 64)
    assert index.tolist() == [5] and value.dtype == torch.float16
    assert reference.exception_table(sample(1000), 64) == (None, None)
    assert torch.equal(ops.encode_flat(x, 2, 64, True, 0)[1], reference.encode_flat(x, 2, 64, True, 0)[1])


def test_bad_arguments_raise_value_errors_through_the_dispatcher(extension):
    x = sample(100)
    with pytest.raises(ValueError, match="bits must be one of"):
        torch.ops.daf.format1_encode(x, 3, 16, False, 0)
    with pytest.raises(ValueError, match="group_size must be positive"):
        torch.ops.daf.format1_encode(x, 1, 4, False, 0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        ops.encode_flat(x, 2, 16, False, 0, strategy="fastest")
    for strategy_refused in (torch.ops.daf.format1_encode, encode_default):
        with pytest.raises(ValueError, match="strategy must be one of"):
            strategy_refused(x, 2, 16, False, 0, 2)
    payload = torch.ops.daf.format1_encode(x, 2, 16, False, 0)[0]
    with pytest.raises(ValueError, match=r"payload must be uint8 \[56\] for 100 values"):
        torch.ops.daf.format1_decode(payload[:-1], 100, 2, 16, torch.float32)


def test_kernels_import_nothing_from_the_codec():
    """Layering: daf.codec sits on daf.kernels, never the other way round."""
    root = Path(daf.kernels.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n == "daf.codec" or n.startswith("daf.codec.") for n in names), path


def test_the_codec_reference_is_the_kernels_reference():
    from daf.codec import reference as codec_reference

    assert codec_reference.encode_flat is reference.encode_flat
    assert codec_reference.decode_flat is reference.decode_flat


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 5000), log_group=st.integers(3, 12), bits=st.sampled_from([1, 2, 4, 8]),
       seed=st.integers(0, 2**16))
def test_decode_signed_on_the_kernels_is_the_references_select(extension, numel, log_group, bits, seed):
    """A ReLU output's codes restored with its exact sign bits: the kernels' one pass (AVX-512 lanes and the
    scalar tail) equals the reference's decode, mask and select, value for value; zeros, the floor and NaN
    included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g).relu()
    x[torch.rand(numel, generator=g) < 0.05] = 1e-30  # positive, but codes to 0: restored at the floor
    payload = torch.ops.daf.format1_encode(x, bits, 2**log_group, False, 0)[0]
    signs = torch.ops.daf.relu_mask_encode(x)
    args = (payload, signs, numel, bits, 2**log_group, 2.0 ** -64, torch.float32)
    got = torch.ops.daf.format1_decode_signed(*args)
    expected = torch.ops.daf.format1_decode_signed.default._op_dk(DEFAULT, *args)
    assert torch.equal(got, expected)
    assert bool(((got > 0) == (x > 0)).all())  # no element crossed 0


def test_decode_signed_by_hand_and_in_bfloat16_through_the_reference(extension):
    values = torch.arange(16.0) * 17 - 68  # -68 .. 187: a step of 1 at 8 bits, every code exact
    payload = torch.ops.daf.format1_encode(values, 8, 16, False, 0)[0]
    signs = torch.tensor([0b11110000, 0b11111111], dtype=torch.uint8)  # elements 4 .. 15 positive
    got = torch.ops.daf.format1_decode_signed(payload, signs, 16, 8, 16, 2.0 ** -64, torch.float32)
    assert torch.equal(got, torch.cat([values[:4], torch.tensor([2.0 ** -64]), values[5:]]))  # 0 -> the floor
    half = torch.ops.daf.format1_decode_signed(payload, signs, 16, 8, 16, 2.0 ** -14, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.float(), torch.cat([values[:4], torch.tensor([2.0 ** -14]), values[5:]]))
