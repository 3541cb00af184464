"""Restored activations of convolutions, batch norms and ReLUs come back channels-last on the CPU
(daf.runtime.layout): same values, same gradients, less memory in backward; other saves keep their layout."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import daf
from daf.allocator.native import tensor_bytes
from daf.kernels.layout_ops import to_channels_last
from daf.runtime.layout import restores_channels_last
from daf.tracing import OpCall

CL = torch.channels_last


def is_channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=CL) and not t.is_contiguous()


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 6)] * 4), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.bool]),
       order=st.sampled_from(["nchw", "cl", "transposed"]))
def test_to_channels_last_equals_pytorchs_copy(shape, dtype, order):
    x = torch.randn(shape).gt(0) if dtype is torch.bool else torch.randn(shape).to(dtype)
    if order == "cl":
        x = x.contiguous(memory_format=CL)
    elif order == "transposed":  # a layout that is neither
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    y = to_channels_last(x)
    assert y.is_contiguous(memory_format=CL)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, x)
    if x.is_contiguous(memory_format=CL):
        assert y is x  # nothing copied


def op_of(func, *args):
    return OpCall(func, args, {})


@pytest.mark.parametrize("func, shape, memory_format, device, enabled, expected", [
    (torch.nn.functional.conv2d, (2, 3, 4, 4), torch.contiguous_format, "cpu", True, True),
    (torch.nn.functional.batch_norm, (2, 3, 4, 4), torch.contiguous_format, "cpu", True, True),
    (torch.relu, (2, 3, 4, 4), torch.contiguous_format, "cpu", True, True),
    (torch.nn.functional.conv2d, (2, 3, 4, 4), torch.contiguous_format, "cpu", False, False),  # turned off
    (torch.nn.functional.conv2d, (2, 3, 4, 4), CL, "cpu", True, False),  # already channels-last
    (torch.nn.functional.conv1d, (2, 3, 4), torch.contiguous_format, "cpu", True, False),  # not 4-D
    (torch.softmax, (2, 3, 4, 4), torch.contiguous_format, "cpu", True, False),  # attention maps are 4-D too
    (torch.matmul, (2, 3, 4, 4), torch.contiguous_format, "cpu", True, False),
    (torch.nn.functional.conv2d, (2, 3, 4, 4), torch.contiguous_format, "meta", True, False),  # not the CPU
])
def test_which_saves_are_restored_channels_last(func, shape, memory_format, device, enabled, expected):
    tensor = torch.empty(shape, device=device).contiguous(memory_format=memory_format)
    assert restores_channels_last(tensor, op_of(func, tensor), enabled) is expected
    assert restores_channels_last(tensor, None, enabled) is False


class Block(torch.nn.Module):
    """conv-bn-relu-conv-bn plus the input: ResNet's basic block."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def net(channels: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, channels, 3, padding=1), torch.nn.ReLU(), Block(channels),
                               Block(channels), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(channels, 10))


def saved_inputs(loss: torch.Tensor) -> list[torch.Tensor]:
    """The inputs the graph's convolution and batch-norm nodes get back in backward (through DAF's unpack)."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name.startswith(("ConvolutionBackward", "NativeBatchNormBackward")):
            found.append(node._saved_input)
        elif name.startswith("ReluBackward"):
            found.append(node._saved_result)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("channels_last", [True, False])
def test_conv_bn_relu_saves_come_back_in_the_configured_layout(channels_last):
    model = daf.wrap(net(), bits=8, min_numel=1, channels_last=channels_last)
    loss = model(torch.randn(4, 3, 12, 12)).sum()
    restored = [t for t in saved_inputs(loss) if t.dim() == 4 and t.shape[0] == 4 and t.shape[1] > 3]
    assert len(restored) >= 9  # 4 convs, 4 batch norms, ReLUs (the stem's input batch is kept raw)
    assert all(is_channels_last(t) == channels_last for t in restored)


@pytest.mark.parametrize("policy", [daf.Uniform(), daf.Adaptive(average=2.0)])
def test_gradients_do_not_depend_on_the_layout(policy):
    """Same codes (same seed), other layout: the gradients differ only by the convolution's float rounding."""
    x, grads = torch.randn(8, 3, 16, 16), []
    for channels_last in (False, True):
        model = daf.wrap(net(), bits=2, policy=policy, seed=3, channels_last=channels_last)
        for _ in range(2):  # the adaptive policy's nonzeros codes start at its first plan
            model.zero_grad()
            model(x).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5 * grads[0].abs().max().item())


class TimesTwo(torch.autograd.Function):
    """A custom op whose backward views its saved tensor flat: it must get the layout it saved."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        assert x.is_contiguous()
        return (grad.reshape(-1) * 2 + 0 * x.view(-1)).view_as(grad)


@pytest.mark.parametrize("custom_first", [False, True])
def test_a_record_a_custom_function_also_saves_is_restored_as_saved(custom_first):
    weight = torch.randn(4, 4, 3, 3, requires_grad=True)
    with daf.compress(torch.nn.Identity(), bits=8, min_numel=1, channels_last=True):
        h = torch.randn(2, 4, 8, 8, requires_grad=True) * 1.0  # with history, so it is stored
        if custom_first:
            y = TimesTwo.apply(h) + torch.nn.functional.conv2d(h, weight, padding=1)
        else:
            y = torch.nn.functional.conv2d(h, weight, padding=1) + TimesTwo.apply(h)
    y.sum().backward()  # TimesTwo.backward asserts the layout and views the tensor flat
    assert weight.grad is not None


def test_config_channels_last_must_be_a_bool():
    with pytest.raises(ValueError, match="Config.channels_last"):
        daf.Config(channels_last="yes")


def backward_peak(channels_last: bool) -> int:
    model = daf.wrap(net(32), bits=2, channels_last=channels_last)
    x = torch.randn(32, 3, 28, 28)
    for _ in range(2):
        loss = model(x).sum()
        start = tensor_bytes(reset_peak=True).live_bytes
        loss.backward()
        peak = tensor_bytes().peak_bytes - start
        model.zero_grad(set_to_none=True)
    daf.unwrap(model)
    return peak


def test_channels_last_lowers_the_peak_of_backward():
    """PyTorch's NCHW convolution backward allocates full-size reorder buffers; channels-last needs none."""
    daf.wrap(torch.nn.Identity())  # installs DAF's allocator, whose counts are exact
    if tensor_bytes() is None:
        pytest.skip("DAF's allocator is not installed in this process (no tcmalloc)")
    full_size = 32 * 32 * 28 * 28 * 4
    assert backward_peak(True) <= backward_peak(False) - 0.9 * full_size  # the exact figure: 1.01 full sizes


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_raw_input_batch_of_a_convolution_comes_back_channels_last(channels, channels_last):
    """Kept raw, it is handed to the convolution's backward as a channels-last copy, exactly strided (a
    one-channel batch is channels-last by its size-1 dimension only, which PyTorch reads as NCHW and
    answers by copying the gradient into NCHW); the batch the caller holds is not touched."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, 8, 3, padding=1)
    x = torch.randn(4, channels, 12, 12)
    (plain,) = torch.autograd.grad(conv(x).square().sum(), conv.weight)
    model = daf.wrap(conv, bits=8, min_numel=1, channels_last=channels_last)
    out = model(x)
    restored = out.grad_fn._saved_input
    assert (restored.stride() == (channels * 144, 1, 12 * channels, channels)) is channels_last
    assert (restored is x) is not channels_last
    assert torch.equal(restored, x) and x.is_contiguous()
    (got,) = torch.autograd.grad(out.square().sum(), conv.weight)
    assert torch.allclose(got, plain, rtol=1e-4, atol=1e-5 * plain.abs().max().item())
