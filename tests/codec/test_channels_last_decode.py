"""``Codecs.decode(packed, channels_last=True)``: every record type comes back channels-last with the
values of its as-saved decode, bit for bit, on the reference and the native backend."""

import pytest
import torch

import daf
from daf.codec.mask import two_values
from daf.codec.registry import Codecs
from daf.codec.spec import Spec
from daf.config import Division

from tests.models import narrow_outliers as Outliers


CODECS = {"minmax": {}, "division": {"codec": Division()}, "outliers": {"codec": Outliers()}}


def feature_map(shape=(3, 64, 6, 6)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4


def both_layouts(codecs: Codecs, packed) -> tuple[torch.Tensor, torch.Tensor]:
    return codecs.decode(packed), codecs.decode(packed, channels_last=True)


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("shape", [(3, 64, 6, 6), (2, 3, 5, 7)])
def test_codes_come_back_channels_last_with_the_same_values(backend, codec, shape):
    codecs = Codecs(daf.Config(backend=backend, **CODECS[codec]))
    x = feature_map(shape)
    packed = codecs.encode("codes", x, Spec(2, 7, consumer="conv2d"))
    as_saved, channels_last = both_layouts(codecs, packed)
    assert channels_last.is_contiguous(memory_format=torch.channels_last)
    assert as_saved.is_contiguous()
    assert torch.equal(channels_last, as_saved)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_masks_come_back_channels_last(backend):
    codecs = Codecs(daf.Config(backend=backend))
    relu = feature_map().clamp(min=0)
    for name, spec in (("relu_mask", Spec(1)), ("mask", Spec(1, values=two_values((relu > 0).float())))):
        x = relu if name == "relu_mask" else (relu > 0).float()
        as_saved, channels_last = both_layouts(codecs, codecs.encode(name, x, spec))
        assert channels_last.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(channels_last, as_saved)


def test_other_ranks_and_layouts_are_left_as_saved():
    codecs = Codecs(daf.Config())
    flat = codecs.encode("codes", torch.randn(40, 30), Spec(4, 1))
    assert codecs.decode(flat, channels_last=True).shape == (40, 30)
    already = feature_map().contiguous(memory_format=torch.channels_last)
    restored = codecs.decode(codecs.encode("codes", already, Spec(4, 1)), channels_last=True)
    assert restored.is_contiguous(memory_format=torch.channels_last)


def test_a_permuted_map_comes_back_channels_last_too():
    codecs = Codecs(daf.Config())
    permuted = feature_map((3, 6, 64, 6)).transpose(1, 2)  # 4-D, dense, neither layout
    packed = codecs.encode("codes", permuted, Spec(4, 1))
    restored = codecs.decode(packed, channels_last=True)
    assert restored.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(restored, codecs.decode(packed))
