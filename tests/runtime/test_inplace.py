"""In-place changes after forward: DAF raises where plain PyTorch raises, naming DAF and the site.

Saved-tensor hooks turn autograd's own version check off; DAF records each saved tensor's
version at pack time and checks it when backward unpacks: for tensors kept raw, parameters,
shared records and compressed records alike.
"""

import pytest
import torch
from torch import nn

import daf

MESSAGE = "modified by an inplace operation"


def _linear(**config):
    torch.manual_seed(0)
    return daf.wrap(nn.Linear(128, 128), bits=8, **config)


def _backward_of(model, change, x=None):
    x = torch.randn(64, 128) if x is None else x
    y = model(x)
    change(x, model)
    y.square().sum().backward()


CHANGES = {
    "add_": lambda x, m: x.add_(1),
    "zero_": lambda x, m: x.zero_(),
    "copy_": lambda x, m: x.copy_(torch.ones_like(x)),
    "set_": lambda x, m: x.set_(torch.ones_like(x)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_input_changed_in_place_raises_like_plain_pytorch(change):
    plain = nn.Linear(128, 128)
    with pytest.raises(RuntimeError, match=MESSAGE):
        _backward_of(plain, CHANGES[change])
    with pytest.raises(RuntimeError, match=rf"DAF \(site <root>#\d\).*{MESSAGE}"):
        _backward_of(_linear(), CHANGES[change])


def test_a_tensor_below_min_numel_changed_in_place_raises():
    model = daf.wrap(nn.Linear(8, 8), bits=8)  # 4x8 inputs: below the default min_numel, kept raw
    with pytest.raises(RuntimeError, match=MESSAGE):
        _backward_of(model, CHANGES["add_"], torch.randn(4, 8))


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_parameter_changed_by_an_optimizer_step_before_backward_raises(wrapped):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128))  # the 2nd weight is saved
    if wrapped:
        daf.wrap(model, bits=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(64, 128)).sum().backward()
    y = model(torch.randn(64, 128))
    optimizer.step()  # the GAN mistake: a step between a forward and its backward
    with pytest.raises(RuntimeError, match=("DAF.*" if wrapped else "") + MESSAGE):
        y.square().sum().backward()


@pytest.mark.parametrize("background", [False, True])
def test_a_compressed_save_changed_in_place_raises(background):
    torch.manual_seed(0)
    model = daf.wrap(nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128)), bits=8, min_numel=1,
                     background=background, audit=daf.Audit(every=0))  # the hook keeps the first output
    hidden = {}
    model[1].register_forward_hook(lambda module, args, out: hidden.setdefault("h", out))
    y = model(torch.randn(64, 128))
    assert any(r.kind == "compressed" and r.shape == (64, 128) for r in daf.report(model).rows)
    with torch.no_grad():
        hidden["h"].mul_(2)  # Tanh's output, which the second Linear shares, stored compressed
    with pytest.raises(RuntimeError, match=rf"DAF \(site 1#0\).*{MESSAGE}"):
        y.sum().backward()


def test_unchanged_tensors_and_in_place_relu_train_as_plain_pytorch():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3))
    model = daf.wrap(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                   nn.Conv2d(8, 4, 3)), bits=8, min_numel=1, rounding="nearest")
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 12, 12)
    for net in (plain, model):
        net(x).square().sum().backward()
    a, b = (torch.cat([p.grad.flatten() for p in net.parameters()]) for net in (plain, model))
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999


class _DoublesItsSave(torch.autograd.Function):
    """A custom Function whose backward changes its saved tensor in place: plain autograd raises at the
    next unpack of that save."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return grad * x


def _two_readers_of_one_save():
    torch.manual_seed(0)
    a = torch.randn(64, 64, requires_grad=True)
    x = a * 1.0
    return (_DoublesItsSave.apply(x) * _DoublesItsSave.apply(x)).sum()


@pytest.mark.parametrize("background", [False, True])
def test_a_backward_that_changes_its_saved_tensor_in_place_raises_like_plain_pytorch(background):
    """Issue 42: DAF handed each reader a decoded copy (the second one the changed copy, from its cache)
    and raised nothing."""
    with pytest.raises(RuntimeError, match=MESSAGE):
        _two_readers_of_one_save().backward()
    with pytest.raises(RuntimeError, match=f"DAF .*{MESSAGE}"):
        with daf.compress(bits=8, min_numel=1, background=background):
            loss = _two_readers_of_one_save()
        loss.backward()
