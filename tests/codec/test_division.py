"""DIVISION: split/join, fallback, native vs reference, paged store, spill and demotion."""

import pytest
import torch

import daf
from daf.policy.exponent_guard import PROBABILITY_BITS
from daf.codec import Spec, codes_codec
from daf.codec.backends import REFERENCE
from daf.codec.division import DivisionCodec, DivisionPacked, join, split
from daf.format import payload_bytes
from daf.memory.paged import PagedStore


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (1, 2, 7, 9), (3, 1, 28, 28), (2, 4, 1, 5)])
def test_split_join_is_exact_without_quantization(shape):
    x = torch.randn(shape)
    low, high = split(x)
    assert low.dtype == torch.bfloat16 and low.shape == (*shape[:2], -(-shape[2] // 8), -(-shape[3] // 8))
    assert torch.allclose(join(low, high), x, atol=1e-6)


def test_low_is_the_block_mean():
    x = torch.randn(1, 1, 8, 16)
    low, _ = split(x)
    expected = x.view(1, 1, 8, 2, 8).mean(dim=(2, 4))
    assert torch.allclose(low.float(), expected, atol=1e-2)


def _codec(**kw):
    return codes_codec(daf.Config(codec=daf.Division(), backend="reference", **kw))


def test_round_trip_error_and_bytes():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16, 16) + torch.linspace(0, 8, 16)  # smooth trend plus noise
    codec = _codec()
    p = codec.encode(x, Spec(2, 1))
    assert isinstance(p, DivisionPacked) and p.bits == 2
    assert p.nbytes == payload_bytes(x.numel(), 2, 256) + p.low.nbytes
    y = codec.decode(p)
    minmax = codes_codec(daf.Config(backend="reference"))
    plain = minmax.decode(minmax.encode(x, Spec(2, 1)))
    assert y.shape == x.shape and (y - x).square().mean() < (plain - x).square().mean()


def test_other_shapes_fall_back_to_minmax():
    codec = _codec()
    for x in (torch.randn(64, 300), torch.randn(4, 3, 1, 1)):
        p = codec.encode(x, Spec(4, 0))
        assert not isinstance(p, DivisionPacked) and codec.decode(p).shape == x.shape


def test_native_and_reference_agree():
    x = torch.randn(2, 3, 20, 12)
    native = codes_codec(daf.Config(codec=daf.Division(), backend="auto"))
    reference = _codec()
    a, b = native.encode(x, Spec(2, 3)), reference.encode(x, Spec(2, 3))
    assert torch.equal(a.payload, b.payload) and torch.equal(a.low, b.low)
    assert torch.equal(native.decode(a), reference.decode(b))


def test_reencode_keeps_low_and_lowers_bits():
    codec = _codec()
    x = torch.randn(2, 3, 16, 16)
    p = codec.encode(x, Spec(8, 0))
    q = codec.reencode(p, 4, seed=1)
    assert isinstance(q, DivisionPacked) and q.bits == 4 and torch.equal(q.low, p.low)
    assert (codec.decode(q) - x).abs().max() < 0.5


def test_through_the_paged_store_with_demotion_and_spill(tmp_path):
    config = daf.Config(codec=daf.Division(), backend="reference", bits=8, budget="120KiB", min_bits=2,
                        spill_dir=str(tmp_path))
    codec = codes_codec(config, REFERENCE)
    store = PagedStore(config, codec.reencode)
    torch.manual_seed(0)
    tensors = [torch.randn(2, 4, 64, 64) for _ in range(6)]
    refs = [store.put(codec.encode(t, Spec(8, i)), float(i), f"site{i}") for i, t in enumerate(tensors)]
    store._check()
    stats = store.stats()
    assert stats["demotions"] > 0
    for ref, t in zip(refs, tensors):
        back = store.get(ref)
        assert isinstance(back, DivisionPacked)
        assert back.bits in (2, 4, 8) and float((codec.decode(back) - t).square().mean()) < 1.5
    for ref in refs:
        store.release(ref)
    store._check()
    store.close()


def test_training_with_division_matches_fp32_roughly():
    from tests.models import SmallCNN, cosine, gradients
    torch.manual_seed(0)
    model, x, y = SmallCNN(), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    reference = gradients(model, x, y)
    daf.wrap(model, codec=daf.Division(), bits=8, min_numel=1)
    assert cosine(reference, gradients(model, x, y)) > 0.999
    assert daf.report(model).sections["codec"]["codec"].startswith("division/")


def test_attention_probabilities_stay_minmax():
    codec = _codec()
    p = torch.softmax(torch.randn(2, 4, 16, 16), -1)
    assert not isinstance(codec.encode(p, Spec(2, 0, "softmax")), DivisionPacked)
    assert isinstance(codec.encode(p, Spec(2, 0, "conv2d")), DivisionPacked)
    x = torch.randn(2, 4, 16, 16, requires_grad=True)
    with daf.compress(bits=2, codec=daf.Division(), min_numel=1, backend="reference") as session:
        y = torch.softmax(x, -1) @ x  # softmax saves its 4-D output
    rows = [r for r in daf.report(session).rows if r.kind == "compressed" and "Softmax" in r.source]
    # no low-frequency part; the probabilities keep 4 bits (daf.policy.exponent_guard)
    assert [r.stored_bytes for r in rows] == [payload_bytes(2048, PROBABILITY_BITS, 256)]
    y.sum().backward()
