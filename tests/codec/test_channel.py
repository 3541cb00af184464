"""Outliers codec: outlier channels exact, inliers in format-1 codes per token or per channel."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import daf
from daf.codec import ChannelPacked, Codecs, Spec, codes_codec
from daf.codec.channel import join_channels, outlier_channels, split_channels
from daf.config import Outliers as _Outliers
from daf.format import payload_bytes
from daf.memory.paged import PagedStore
from tests.models import narrow_outliers as Outliers


def _codec(backend="reference", **kw):
    return codes_codec(daf.Config(codec=Outliers(**kw), backend=backend))


def _with_outliers(shape, channels=(3,), scale=200.0, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., list(channels)] *= scale
    return x


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_split_join_is_exact(axis):
    x = _with_outliers((3, 10, 40))
    index, values, coded, scale = split_channels(x, 2, axis)
    assert 3 in index.tolist() and coded.is_contiguous()
    assert coded.shape == ((30, 40) if axis == "token" else (38, 30))
    assert torch.allclose(join_channels(coded, index, values, tuple(x.shape), axis, scale), x, rtol=1e-6, atol=0)


def _split_plainly(x, count):
    """split_channels for axis "channel" as first written: column gathers and a strided transpose."""
    m = x.detach().reshape(-1, x.shape[-1])
    peak = m.abs().amax(dim=0).float().nan_to_num(posinf=float("inf"), nan=float("inf"))
    index = torch.topk(peak, count, sorted=False).indices.sort().values
    keep = torch.ones(m.shape[1], dtype=torch.bool)
    keep[index] = False
    inliers = m[:, keep].float()
    scale = inliers.abs().amax(dim=1)
    scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    return index, m[:, index], (inliers / scale[:, None]).t().contiguous(), scale


def _join_plainly(coded, values, index, full_shape, scale):
    out = torch.empty(coded.shape[1], full_shape[-1], dtype=values.dtype)
    keep = torch.ones(full_shape[-1], dtype=torch.bool)
    keep[index] = False
    out[:, keep] = (coded.t() * scale[:, None]).to(values.dtype)
    out[:, index] = values
    return out.view(full_shape)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(2, 80), channels=st.integers(16, 150), batch=st.sampled_from([None, 2]),
       count=st.integers(0, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       special=st.sampled_from([None, "nan", "inf", "-inf", "zero_row", "negative_zero"]),
       transposed_input=st.booleans(), seed=st.integers(0, 2**31))
def test_split_join_channel_axis_equal_the_plain_statement(rows, channels, batch, count, dtype, special,
                                                            transposed_input, seed):
    """The transposes by the native kernel, the row gathers and the two-reduction magnitudes give the
    column-gather statement's values bit for bit, special values included; the join inverts either."""
    shape = (rows, channels) if batch is None else (batch, rows, channels)
    x = _with_outliers(shape, channels=(channels // 3,), seed=seed)
    if special is not None:
        flat = x.view(-1, channels)
        if special == "zero_row":
            flat[rows // 2] = 0
        elif special == "negative_zero":
            flat[rows // 2] = -0.0
        else:
            flat[rows // 2, channels // 2] = float(special)
    x = x.to(dtype)
    if transposed_input:  # a non-contiguous save: the same values through a transposed view
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    got, want = split_channels(x, count, "channel"), _split_plainly(x, count)
    for a, b in zip(got, want):
        _assert_same(a, b)
        assert a.is_contiguous()
    joined = join_channels(got[2], got[0], got[1], tuple(x.shape), "channel", got[3])
    _assert_same(joined, _join_plainly(*want[2::-1], tuple(x.shape), want[3]))
    assert joined.dtype == x.dtype and joined.shape == x.shape and joined.is_contiguous()


def _assert_same(a, b):
    """Equal dtype, shape and values (NaN where NaN is)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def test_outlier_count_is_an_exact_ceiling():
    codec = _codec(fraction=0.1)
    assert [codec.outlier_count(c) for c in (16, 30, 31, 700)] == [2, 3, 4, 70]
    assert _codec(fraction=0.5).outlier_count(2) == 1 and _codec(fraction=0.0).outlier_count(64) == 0


def test_outliers_are_the_largest_channels():
    x = _with_outliers((50, 64), channels=(5, 60))
    assert outlier_channels(x, 2).tolist() == [5, 60]
    assert outlier_channels(x, 0).numel() == 0


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 70), channels=st.integers(16, 90), batch=st.sampled_from([None, 1, 3]),
       bits=st.sampled_from([1, 2, 4, 8]), axis=st.sampled_from(["token", "channel"]),
       fraction=st.sampled_from([0.0, 0.01, 0.1]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       rounding=st.sampled_from(["nearest", "stochastic"]), seed=st.integers(0, 2**31))
def test_round_trip(rows, channels, batch, bits, axis, fraction, dtype, rounding, seed):
    """Shape and dtype come back, outlier channels exactly, inliers within one step of their range."""
    shape = (rows, channels) if batch is None else (batch, rows, channels)
    x = _with_outliers(shape, channels=(channels // 2,), seed=seed).to(dtype)
    codec = codes_codec(daf.Config(codec=Outliers(fraction=fraction, axis=axis), backend="reference",
                                   rounding=rounding, group_size=16))
    p = codec.encode(x, Spec(bits, seed))
    assert isinstance(p, ChannelPacked) and p.bits == bits
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    k = p.outlier_index.numel()
    assert k == (0 if fraction == 0 else max(1, -(-round(fraction * 1000) * channels // 1000)))
    m, n = x.reshape(-1, channels).float(), y.reshape(-1, channels).float()
    assert torch.equal(m[:, p.outlier_index], n[:, p.outlier_index])
    keep = torch.ones(channels, dtype=torch.bool)
    keep[p.outlier_index] = False
    inliers = m[:, keep]
    if axis == "token":  # groups of the matrix: at most the range of all inliers
        step = ((inliers.max() - inliers.min()) / (2**bits - 1)).expand_as(inliers)
    else:  # each row scaled into [-1, 1] by its largest |inlier|
        step = (2 * inliers.abs().amax(1, keepdim=True) / (2**bits - 1)).expand_as(inliers)
    slack = 1.02 * step + 0.02 * inliers.abs().max() * (dtype == torch.bfloat16) + 1e-6
    assert ((n[:, keep] - inliers).abs() <= slack).all()


def test_bytes():
    x = _with_outliers((4, 64, 200))
    k = 2  # ceil(0.01 * 200)
    p = _codec(fraction=0.01, axis="token").encode(x, Spec(2, 0))
    assert p.nbytes == payload_bytes(256 * 200, 2, 256) + k * 8 + 256 * k * 4
    p = _codec(fraction=0.01, axis="channel").encode(x, Spec(2, 0))
    assert p.nbytes == payload_bytes(256 * (200 - k), 2, 256) + k * 8 + 256 * k * 4 + 256 * 4  # + row scales


def test_outliers_cut_the_error_of_token_groups():
    x = _with_outliers((512, 256), channels=(7, 100))
    plain = codes_codec(daf.Config(backend="reference", codec=daf.MinMax()))
    error = {name: float((c.decode(c.encode(x, Spec(2, 1))) - x).square().mean())
             for name, c in {"minmax": plain, "outliers": _codec(axis="token")}.items()}
    assert error["outliers"] < error["minmax"] / 100


def test_other_shapes_fall_back_to_minmax():
    codec = _codec()
    for x in (torch.randn(4096), torch.randn(2, 4, 16, 16), torch.randn(64, 8), torch.randn(1, 300)):
        p = codec.encode(x, Spec(4, 0))
        assert not isinstance(p, ChannelPacked) and codec.decode(p).shape == x.shape
    channels_last = torch.randn(2, 8, 8, 32)  # ConvNeXt's LayerNorm and Linear read [N, H, W, C]
    assert isinstance(codec.encode(channels_last, Spec(2, 0, "layer_norm")), ChannelPacked)
    assert not isinstance(codec.encode(channels_last, Spec(2, 0, "matmul")), ChannelPacked)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_native_and_reference_agree(axis, rounding):
    native = codes_codec(daf.Config(codec=Outliers(axis=axis), backend="auto", rounding=rounding))
    if native.minmax.backend.name == "reference":
        pytest.skip("native kernels unavailable: " + daf.native_status())
    reference = codes_codec(daf.Config(codec=Outliers(axis=axis), backend="reference", rounding=rounding))
    for bits in (1, 2, 4, 8):
        x = _with_outliers((3, 100, 96))  # 300 rows: groups along tokens of 4, not of 256
        a, b = native.encode(x, Spec(bits, 5)), reference.encode(x, Spec(bits, 5))
        assert torch.equal(a.payload, b.payload) and torch.equal(a.outlier_index, b.outlier_index)
        assert torch.equal(native.decode(a), reference.decode(b))


def test_channel_groups_do_not_mix_channels():
    p = _codec(axis="channel").encode(torch.randn(2, 48, 32), Spec(2, 0))
    assert p.group_size == 32  # 96 rows: the largest power of two dividing it
    assert _codec(axis="channel").encode(torch.randn(512, 32), Spec(2, 0)).group_size == 256


def test_reencode_keeps_outliers_and_lowers_bits():
    codec = _codec()
    x = _with_outliers((256, 64))
    q = codec.reencode(codec.encode(x, Spec(8, 0)), 2, seed=1)
    assert isinstance(q, ChannelPacked) and q.bits == 2
    assert torch.equal(codec.decode(q)[:, 3], x[:, 3])


def test_codecs_dispatch_and_paged_store(tmp_path):
    config = daf.Config(codec=Outliers(), backend="reference", bits=8, budget="64KiB", min_bits=2,
                        spill_dir=str(tmp_path))
    codecs = Codecs(config)
    store = PagedStore(config, codecs.reencode)
    tensors = [_with_outliers((128, 128), seed=i) for i in range(8)]
    refs = [store.put(codecs.encode("codes", t, Spec(8, i)), float(i), f"site{i}") for i, t in enumerate(tensors)]
    store._check()
    assert store.stats()["demotions"] > 0
    for ref, t in zip(refs, tensors):
        back = store.get(ref)
        assert isinstance(back, ChannelPacked)
        assert torch.equal(codecs.decode(back)[:, 3], t[:, 3])
        store.release(ref)
    store.close()


def test_config_validation_and_round_trip():
    for bad in ({"fraction": 0.7}, {"fraction": -1}, {"axis": "row"}, {"derivatives": 1}, {"min_channels": 8},
                {"min_channels": 64.0}):
        with pytest.raises(ValueError, match="Outliers"):
            Outliers(**bad)
    config = daf.Config(codec=Outliers(fraction=0.02, axis="channel", derivatives=True))
    data = config.to_dict()
    assert data["codec"] == {"kind": "outliers", "fraction": 0.02, "axis": "channel", "derivatives": True,
                             "min_channels": 16, "above": 0.0}
    assert daf.Config.from_dict(data) == config


def test_training_step_with_an_outlier_channel():
    """A LayerNorm block whose input has an outlier channel: with it kept exact, 2-bit codes lose far less
    (measured: cosine 0.87 against 0.55)."""
    from tests.models import cosine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(128), torch.nn.Linear(128, 128), torch.nn.LayerNorm(128))
    x = _with_outliers((8, 64, 128), channels=(11,), scale=100.0).requires_grad_(True)
    # not the sum of squares of a LayerNorm's output: that is constant, its true gradient 0 and the cosine noise
    target = torch.randn(8, 64, 128)

    def grad(m):
        m.zero_grad()
        x.grad = None
        (m(x * 1.0) * target).sum().backward()  # x * 1.0: an input with history, so that DAF stores it
        return torch.cat([x.grad.flatten()] + [p.grad.flatten() for p in m.parameters()])

    reference = grad(model)
    results = {}
    for name, codec in {"minmax": daf.MinMax(), "outliers": Outliers()}.items():
        with daf.compress(bits=2, codec=codec, backend="reference"):
            results[name] = cosine(reference, grad(model))
    assert results["outliers"] > results["minmax"] + 0.2


def test_saves_with_fewer_channels_than_min_channels_use_minmax():
    """An attention head's q, k, v [batch * heads, tokens, 32]: the exact channel and the token scales would
    cost 2 bits per element, so the default (128 channels) codes them with MinMax; 128 channels are split."""
    codec = codes_codec(daf.Config(codec=_Outliers(), backend="reference"))
    narrow, wide = torch.randn(48, 64, 32), torch.randn(4, 64, 128)
    assert type(codec.encode(narrow, Spec(2, seed=0))) is not ChannelPacked
    assert isinstance(codec.encode(wide, Spec(2, seed=0)), ChannelPacked)
    assert isinstance(codes_codec(daf.Config(codec=_Outliers(min_channels=32), backend="reference")).encode(
        narrow, Spec(2, seed=0)), ChannelPacked)
    minmax = codes_codec(daf.Config(backend="reference")).encode(narrow, Spec(2, seed=0))
    assert codec.encode(narrow, Spec(2, seed=0)).nbytes == minmax.nbytes


@pytest.mark.parametrize("bits, split", [(2, False), (4, True), (8, True)])
def test_an_nchw_feature_map_with_large_channels_read_by_a_convolution_is_split_along_dimension_1(bits, split):
    """A ConvNeXt's LayerNorm output read by its downsampling convolution: the large channels are in
    dimension 1. At 4 bits and more they are kept exact (the record restores the NCHW shape); 2-bit feature
    maps (ReLU CNNs) are not checked (MinMax)."""
    codec = codes_codec(daf.Config(backend="reference"))  # the default: Outliers(above=8, min_channels=32)
    x = torch.randn(4, 32, 6, 6)
    x[:, 5] *= 60
    packed = codec.encode(x, Spec(bits, seed=0, consumer="conv2d"))
    assert isinstance(packed, ChannelPacked) == split
    y = codec.decode(packed)
    assert y.shape == x.shape
    if split:
        assert packed.channel_dim == 1 and 5 in packed.outlier_index.tolist()
        assert torch.equal(y[:, 5], x[:, 5])
        again = codec.decode(codec.reencode(packed, 2, seed=1))
        assert again.shape == x.shape and torch.equal(again[:, 5], x[:, 5])
    inliers = torch.cat([x[:, :5], x[:, 6:]], 1)
    error = (torch.cat([y[:, :5], y[:, 6:]], 1) - inliers).abs().max() / inliers.abs().max()
    assert error < (0.2 if bits == 4 else 0.02) or not split


def test_an_nchw_feature_map_without_large_channels_is_coded_as_minmax():
    codec = codes_codec(daf.Config(backend="reference"))
    x = torch.randn(4, 32, 6, 6)
    assert type(codec.encode(x, Spec(4, seed=0, consumer="conv2d"))) is not ChannelPacked


def _statement(op):
    """The plain-PyTorch default implementation of a ``daf::channel_*`` op, whatever is registered for CPU."""
    return lambda *args: op.default._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args)


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(64, 40), (3, 96, 48), (2, 33, 130), (512, 16)]), bits=st.sampled_from([1, 2, 4, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16),
       rounding=st.sampled_from(["stochastic", "nearest"]), special=st.sampled_from([None, "nan", "inf", "zero_row"]))
def test_the_kernels_store_and_restore_the_statements_bytes(shape, bits, dtype, seed, rounding, special):
    """The whole codec on the native split and join against the same codec on their plain-PyTorch statement:
    the same stored bytes (codes, side table, token scales) and the same restored bits."""
    from daf.kernels import channel_ops
    from daf.kernels.build import load_extension
    if load_extension().module is None:
        pytest.skip("native kernels unavailable")
    x = _with_outliers(shape, channels=(1, shape[-1] - 2), seed=seed)
    if special is not None:
        flat = x.view(-1, shape[-1])
        flat[seed % flat.shape[0]] = 0.0 if special == "zero_row" else float(special)
    x = x.to(dtype)
    codec = codes_codec(daf.Config(codec=_Outliers(fraction=0.05, min_channels=16), rounding=rounding))
    spec = Spec(bits, seed=seed, consumer="layer_norm")
    fast = codec.encode(x, spec)
    assert isinstance(fast, ChannelPacked)
    restored = codec.decode(fast)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(channel_ops, "channel_split", _statement(torch.ops.daf.channel_split))
        patch.setattr(channel_ops, "channel_join", _statement(torch.ops.daf.channel_join))
        plain = codec.encode(x, spec)
        restored_plainly = codec.decode(plain)
    for name in ("payload", "exc_index", "exc_value", "outlier_index", "outlier_values", "row_scale"):
        a, b = getattr(fast, name), getattr(plain, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(_bit_view(a), _bit_view(b)), name
    assert (fast.shape, fast.group_size, fast.bits) == (plain.shape, plain.group_size, plain.bits)
    assert torch.equal(_bit_view(restored), _bit_view(restored_plainly))


def _bit_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
