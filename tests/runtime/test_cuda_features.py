"""The features built after the first GPU run, on CUDA tensors: exact masks, ReLU nonzeros, the
adaptive policy, the rule for what backward exponentiates, DIVISION, background packing.

Public API only. Skipped where no GPU is present (CI has none); run on a lent GPU machine with
``pytest tests/runtime/test_cuda_features.py``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf
from tests.models import SmallCNN, cosine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SdpaBlock(nn.Module):
    """Fused attention (flash / memory-efficient kernels on CUDA), dropout and a log-softmax head."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(4 * dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return F.log_softmax(self.head(self.drop(F.relu(self.fc(h + x)))), dim=-1)


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout mask in every run
    out = model(x)
    target = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
    F.nll_loss(out.flatten(0, -2), target.flatten()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


CASES = {
    "cnn": (SmallCNN, (16, 3, 32, 32)),
    "sdpa": (SdpaBlock, (8, 64, 64)),
}


def _pair(name: str, dtype: torch.dtype = torch.float32):
    make, shape = CASES[name]
    torch.manual_seed(0)
    model = make().cuda().to(dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if name == "cnn":
        return model, x, lambda m, x: _cnn_grads(m, x)
    return model, x, _grads


def _cnn_grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("settings", [
    dict(bits=8),
    dict(bits=8, masks=False),
    dict(bits=8, background=True),
    dict(bits=8, codec=daf.Division()),
    dict(policy=daf.Adaptive(average=8.0, replan_every=1)),
], ids=["uniform", "no-masks", "background", "division", "adaptive"])
def test_cuda_gradients_close_to_fp32(name, settings):
    model, x, grads = _pair(name)
    reference = grads(model, x)
    daf.wrap(model, min_numel=1, **settings)
    for _ in range(3):  # the adaptive policy plans after its first steps
        got = grads(model, x)
        assert cosine(reference, got) > 0.999
    report = daf.report(model)
    assert report.totals()["sites"]["compressed"] > 0
    if settings.get("masks", True):
        assert report.totals()["sites"]["mask"] > 0  # ReLU's own save (and dropout's) as exact masks


def test_cuda_adaptive_two_bits_trains_and_plans():
    model, x, grads = _pair("cnn")
    reference = grads(model, x)
    daf.wrap(model, min_numel=1, policy=daf.Adaptive(average=2.0, replan_every=1))
    for _ in range(4):
        got = grads(model, x)
    assert torch.isfinite(got).all()
    assert cosine(reference, got) > 0.9
    assert daf.report(model).sections["policy"]


def test_cuda_fused_attention_saves_keep_eight_bits():
    model, x, grads = _pair("sdpa", torch.float16)
    daf.wrap(model, min_numel=1, bits=2)
    got = grads(model, x)
    assert torch.isfinite(got).all()
    eight = [r for r in daf.report(model).rows if r.kind == "compressed" and r.bits == 8]
    # q, k, v (saved as views of the projection), attention's output, and log_softmax's output
    assert any("ScaledDotProduct" in r.source for r in eight)
    assert any("LogSoftmax" in r.source for r in eight)
    assert len(eight) >= 5
