"""log_softmax's output as codes of its probabilities: what decoding gives, slices, bytes, routing."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import daf
from daf.codec import Spec
from daf.codec import logprob as logprob_module
from daf.codec.backends import REFERENCE, select_backend
from daf.codec.logprob import LogProbCodec, LogProbPacked
from daf.runtime import Context, Kind, route
from daf.tracing import READERS, OpCall, stored_as_probabilities


def _log_probs(rows: int, classes: int, sharpness: float = 10.0, dtype=torch.float32) -> torch.Tensor:
    torch.manual_seed(rows * 7 + classes)
    return F.log_softmax(torch.randn(rows, classes) * sharpness, -1).to(dtype)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), classes=st.integers(2, 700), sharpness=st.floats(0.1, 40),
       bits=st.sampled_from([2, 4, 8]), group=st.sampled_from([16, 256]), transpose=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_decoded_probabilities_are_within_one_step(rows, classes, sharpness, bits, group, transpose, dtype):
    y = _log_probs(rows, classes, sharpness, dtype)
    y = y.t() if transpose else y
    codec = LogProbCodec(REFERENCE, group)
    packed = codec.encode(y, Spec(bits, 3))
    back = codec.decode(packed)
    assert back.shape == y.shape and back.dtype == y.dtype
    assert [s for s, n in zip(back.stride(), back.shape) if n > 1] == [s for s, n in zip(y.stride(), y.shape) if n > 1]
    p, q = y.float().exp(), back.float().exp()
    # a group's step is at most (max - 0) / (2**b - 1), rounded up to bfloat16 (under 1% more); a bfloat16
    # logarithm adds its own rounding, 2**-9 relative: p * |log p| * 2**-9 <= 2**-9 / e
    own_rounding = 2**-9 / 2.718 if dtype == torch.bfloat16 else 1e-6
    assert (q - p).abs().max() <= 1.01 / (2**bits - 1) + own_rounding
    assert packed.nbytes == -(-y.numel() // group) * (4 + group * bits // 8)  # no side table


def test_stochastic_rounding_keeps_probabilities_unbiased():
    y = _log_probs(4, 300, 3.0)
    codec = LogProbCodec(REFERENCE, 256)
    mean = torch.stack([codec.decode(codec.encode(y, Spec(2, seed))).exp() for seed in range(400)]).mean(0)
    assert (mean - y.exp()).abs().max() < 0.02  # the 2-bit step here is up to ~0.3


def test_zero_probabilities_decode_to_minus_infinity_and_exp_gives_them_back():
    y = torch.full((1, 512), -200.0)  # exp underflows to 0 (and anything under 2**-100 counts as 0)
    y[0, 7] = 0.0
    codec = LogProbCodec(REFERENCE, 256)
    packed = codec.encode(y, Spec(4, 0))
    back = codec.decode(packed)
    assert packed.exc_index is None  # not a "tiny" group stored element by element
    assert back[0, 7] == 0 and torch.isneginf(back[0, :7]).all()
    assert torch.equal(back.exp(), y.exp())


def test_nan_comes_back_where_it_was_across_slices(monkeypatch):
    monkeypatch.setattr(logprob_module, "SLICE_ELEMENTS", 512)
    y = _log_probs(8, 300)
    y[5, 17] = float("nan")  # element 1517: the third slice
    codec = LogProbCodec(REFERENCE, 256)
    back = codec.decode(codec.encode(y, Spec(4, 0)))
    assert torch.isnan(back).nonzero().tolist() == [[5, 17]]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_slices_change_only_the_noise(monkeypatch, rounding):
    """Under nearest rounding slicing gives the bytes of one pass; under stochastic each slice draws its
    own noise, still within a step."""
    y = _log_probs(16, 1000)
    whole = LogProbCodec(REFERENCE, 256, rounding).encode(y, Spec(4, 9))
    monkeypatch.setattr(logprob_module, "SLICE_ELEMENTS", 1024)
    sliced = LogProbCodec(REFERENCE, 256, rounding).encode(y, Spec(4, 9))
    assert sliced.payload.shape == whole.payload.shape
    assert torch.equal(sliced.payload, whole.payload) == (rounding == "nearest")


def test_native_and_reference_agree():
    backend = select_backend("auto")
    if backend.name == "reference":
        pytest.skip("native kernels unavailable: " + daf.native_status())
    y = _log_probs(64, 3000)
    for rounding in ("nearest", "stochastic"):
        a = LogProbCodec(backend, 256, rounding).encode(y, Spec(4, 5))
        b = LogProbCodec(REFERENCE, 256, rounding).encode(y, Spec(4, 5))
        assert torch.equal(a.payload, b.payload)
        assert torch.equal(LogProbCodec(backend).decode(a), LogProbCodec(REFERENCE).decode(b))


def test_reencode_keeps_the_form_at_fewer_bits():
    y = _log_probs(8, 512)
    codec = LogProbCodec(REFERENCE, 256)
    fewer = codec.reencode(codec.encode(y, Spec(4, 1)), 2, 2)
    assert isinstance(fewer, LogProbPacked) and fewer.bits == 2 and fewer.log_dtype == torch.float32
    assert (codec.decode(fewer).exp() - y.exp()).abs().max() <= 1.01 / 3


def _context(op: OpCall | None) -> Context:
    return Context(site="m#0", op=op, is_parameter=False, shared=None, relu_mask=None, masks=True, min_numel=16,
                   nonzeros_only=False, bits_for=lambda site, x, op: 4)


@pytest.mark.parametrize("func, codec", [(F.cross_entropy, "logprobs"), (F.log_softmax, "logprobs"),
                                         (F.nll_loss, "logprobs"), (torch.mul, "codes")])
def test_route_stores_probabilities_only_for_ops_that_read_them_through_exp(func, codec):
    y = F.log_softmax(torch.randn(8, 64, requires_grad=True), -1)
    encoding = route(y, _context(OpCall(func, (), {})))
    assert (encoding.kind, encoding.codec) == (Kind.CODES, codec)
    assert stored_as_probabilities(y, OpCall(func, (), {})) == (func.__name__ in READERS)


def test_route_codes_the_logarithm_when_the_op_is_unknown():
    y = F.log_softmax(torch.randn(8, 64, requires_grad=True), -1)
    assert route(y, _context(None)).codec == "codes"
    assert route(torch.randn(8, 64, requires_grad=True) * 1, _context(OpCall(F.cross_entropy, (), {}))).codec == "codes"
