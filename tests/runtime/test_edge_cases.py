"""The corners: non-finite values, odd shapes and layouts, dtypes, double backward, checkpointing, exceptions."""

import gc
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import daf
from daf.runtime import Kind, route
from daf.runtime import session as session_module
from tests.models import SmallCNN, TransformerBlock


class Saver(nn.Module):
    """Saves ``x + bias`` (bias 0) through a multiplication so the test controls exactly what is stored;
    the addition gives it autograd history (tensors without history are kept raw)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(size))
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return (x + self.bias) * self.weight


def saved_and_restored(x: torch.Tensor, **config) -> torch.Tensor:
    """What backward sees of ``x`` (through d(x*w)/dw = x) with DAF at 8 bits."""
    model = daf.wrap(Saver(x.shape[-1]), bits=8, min_numel=1, rounding="nearest", **config)
    model(x).sum().backward()
    grad = model.weight.grad
    reference = x.sum(dim=tuple(range(x.dim() - 1)))
    return grad, reference


def test_nan_and_inf_pass_through_without_corrupting_neighbours():
    x = torch.randn(64, 256)
    x[3, 7], x[10, 0], x[20, 9] = float("nan"), float("inf"), -float("inf")
    model = daf.wrap(Saver(256), bits=8, min_numel=1, rounding="nearest")
    model(x).sum().backward()
    grad = model.weight.grad
    assert math.isnan(grad[7]) and grad[0] == float("inf") and grad[9] == -float("inf")
    clean = [c for c in range(256) if c not in (0, 7, 9)]
    assert torch.allclose(grad[clean], x[:, clean].sum(0), atol=0.5)


def _relu_net_with_a_nan_unit() -> nn.Sequential:
    """Two ReLUs: the first output is clean, the second is NaN in hidden unit 5 (bias NaN) for every
    row. The loss ``out.sum()`` has a finite gradient, so only ``out`` and ``net[4].weight.grad[:, 5]``
    are NaN: plain autograd passes the gradient through ReLU where its output is NaN."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    with torch.no_grad():
        net[2].bias[5] = float("nan")
    return net


def _input_and_parameter_grads(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    net(x).sum().backward()
    return [x.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("policy", ["uniform", "adaptive"])
def test_nan_in_a_relu_output_passes_the_gradient_like_plain_autograd(policy, monkeypatch):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    reference = _input_and_parameter_grads(_relu_net_with_a_nan_unit(), x)
    assert float(reference[4][5]) != 0.0  # the NaN unit's bias gets a gradient in plain autograd
    settings = dict(bits=8) if policy == "uniform" else dict(policy=daf.Adaptive(average=8.0))
    model = daf.wrap(_relu_net_with_a_nan_unit(), min_numel=1, audit=daf.Audit(every=0), **settings)  # counts routes
    routes = []

    def spy(tensor, context):
        encoding = route(tensor, context)
        if encoding.kind in (Kind.CODES, Kind.NONZEROS) and type(tensor.grad_fn).__name__ == "ReluBackward0":
            routes.append((tuple(tensor.shape), encoding.kind is Kind.NONZEROS))
        return encoding

    monkeypatch.setattr(session_module, "route", spy)
    got = _input_and_parameter_grads(model, x)
    # adaptive: the clean ReLU output's nonzeros get codes (the mask gives its zeros); the one with a
    # NaN is stored whole. Uniform never takes the nonzeros path.
    assert routes == [((64, 64), policy == "adaptive"), ((64, 32), False)]
    assert [r.kind for r in daf.report(model).rows] == ["mask", "compressed", "mask", "compressed"]
    for name, g, ref in zip(["x"] + [n for n, _ in model.named_parameters()], got, reference):
        assert torch.equal(g.isnan(), ref.isnan()), name
        finite = ~ref.isnan()
        assert float((g[finite] - ref[finite]).norm() / ref[finite].norm()) < 0.02, name
    assert math.isclose(float(got[4][5]), float(reference[4][5]), rel_tol=0.02)


@pytest.mark.parametrize("shape", [(0, 8), (5, 0, 3)])
def test_empty_tensors(shape):
    model = daf.wrap(nn.Sequential(nn.Linear(shape[-1], 4), nn.Tanh()), min_numel=0)
    x = torch.randn(shape, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.shape == x.shape


def test_zero_dim_tensor_saved():
    scale = torch.tensor(3.0, requires_grad=True)
    with daf.compress(min_numel=0):
        y = torch.exp(scale * 2)  # exp saves its 0-d result
    y.backward()
    assert torch.allclose(scale.grad, 2 * torch.exp(torch.tensor(6.0)), rtol=0.02)


def test_non_contiguous_views_and_channels_last():
    x = torch.randn(16, 64, 8)[:, :, 3]
    grad, reference = saved_and_restored(x)
    assert torch.allclose(grad, reference, atol=0.3)
    model = daf.wrap(SmallCNN().to(memory_format=torch.channels_last), bits=8)
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out))
    x = torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_restored_tensor_keeps_memory_format():
    restored = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            restored.append(x)
            return grad

    base = torch.randn(2, 16, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    with daf.compress(bits=8, min_numel=1) as session:
        x = base * 1.0  # has autograd history, still channels_last
        y = Probe.apply(x)
    y.sum().backward()
    assert [r.kind for r in daf.report(session).rows if r.source == "MulBackward0"] == ["compressed"]
    assert restored[0].is_contiguous(memory_format=torch.channels_last)
    assert restored[0].shape == x.shape and restored[0].dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype):
    model = daf.wrap(TransformerBlock().to(dtype), bits=8, min_numel=1)
    x = torch.randn(2, 16, 64, dtype=dtype)
    model(x).float().square().mean().backward()
    rows = daf.report(model).rows
    assert any(r.kind == "compressed" and r.dtype == str(dtype).replace("torch.", "") for r in rows)
    assert all(p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in model.parameters())


def test_retain_graph_and_double_backward():
    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    model = daf.wrap(nn.Sequential(lin, nn.Tanh(), nn.Linear(32, 1)), bits=8, min_numel=1)
    x = torch.randn(64, 32, requires_grad=True)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    first = lin.weight.grad.clone()
    loss.backward()  # unpack runs a second time
    assert torch.allclose(lin.weight.grad, 2 * first, rtol=1e-5, atol=1e-6)
    # double backward: gradient of a gradient norm
    lin.zero_grad()
    out = model(x).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    gx.square().sum().backward()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TransformerBlock()
        self.outer = nn.Linear(64, 64)

    def forward(self, x):
        return self.outer(checkpoint(self.inner, x, use_reentrant=False))


def test_non_reentrant_checkpoint_inside_wrapped_model():
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(4, 16, 64)
    model(x).square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    daf.wrap(model, bits=8)
    model(x).square().mean().backward()
    for g, r in zip((p.grad for p in model.parameters()), reference):
        assert torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0) > 0.999


def test_exception_in_forward_removes_hooks_and_leaks_nothing():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            y = torch.tanh(self.lin(x))
            raise RuntimeError("boom")

    model = daf.wrap(Boom(), min_numel=1)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(32, 64))
    gc.collect()
    session = daf.session_of(model)
    assert len(session.store) == 0
    # the saved-tensor hooks were popped: a plain op now saves its input uncompressed
    a = torch.randn(128, 128, requires_grad=True)
    b = torch.tanh(a)
    assert b.grad_fn._saved_result is not None and b.grad_fn._saved_result.shape == (128, 128)
    assert session.forwards == 1
    x = torch.randn(8, 64)
    model.lin(x).sum().backward()  # the model still trains


def test_exception_inside_compress_block_pops_hooks():
    with pytest.raises(KeyError):
        with daf.compress(min_numel=1):
            raise KeyError("x")
    a = torch.randn(64, 64, requires_grad=True)
    assert torch.equal(torch.tanh(a).grad_fn._saved_result, torch.tanh(a))
