"""Background packing: same results as packing inline, tensors released, in-place misuse caught."""

import gc
import weakref

import pytest
import torch

import daf
from daf.runtime import Session
from daf.runtime.background import BackgroundPacker
from tests.models import SmallCNN


def gradients_and_report(background, backend="auto"):
    torch.manual_seed(0)
    model = SmallCNN()
    daf.wrap(model, bits=2, min_numel=1, background=background, backend=backend)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()], daf.report(model)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_background_gives_the_same_gradients_and_report(backend):
    inline_grads, inline_report = gradients_and_report(False, backend)
    background_grads, background_report = gradients_and_report(True, backend)
    # Seeds are drawn on the main thread in pack order, so the bytes are the same.
    assert all(torch.equal(a, b) for a, b in zip(inline_grads, background_grads))
    assert [r.stored_bytes for r in background_report.rows] == [r.stored_bytes for r in inline_report.rows]
    assert background_report.stored_bytes > 0


def test_packed_tensor_is_released_once_packed():
    session = Session(daf.Config(background=True, min_numel=1))
    x = torch.randn(64, 64, requires_grad=True)
    session.begin_forward()
    with session.hooks():
        h = (x * 2).relu()
        loss = h.sigmoid().sum()
    alive = weakref.ref(h)
    del h
    session.end_forward()  # waits for the worker
    gc.collect()
    assert alive() is None  # only the packed form is left for backward
    loss.backward()
    assert x.grad is not None and x.grad.shape == x.shape
    session.close()


def test_in_place_change_during_background_packing_is_an_error():
    from daf.codec import Codecs, Spec

    packer = BackgroundPacker(Codecs(daf.Config()))
    x = torch.randn(1000)

    class Meddling:
        """A codec stand-in that lets the test modify the tensor mid-encode."""

        def encode(self, name, tensor, spec):
            tensor.add_(1)
            return None

    packer.codecs = Meddling()
    with pytest.raises(RuntimeError, match="modified in place"):
        packer.submit("codes", x, Spec(2, 0)).result()
    packer.close()
