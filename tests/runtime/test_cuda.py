"""DAF on CUDA tensors: the plain-PyTorch path must work on any device.

Skipped where no GPU is present (CI has none); run on a lent GPU machine with
``pytest tests/runtime/test_cuda.py``.
"""

import pytest
import torch

import daf
from daf.codec.minmax import decode, encode
from tests.models import SmallCNN, TransformerBlock, cosine, gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_bytes_equal_cpu_bytes(bits, rounding, dtype):
    # One packed layout for every device: a payload made on the GPU decodes on the CPU and back.
    x = torch.randn(5000, generator=torch.Generator().manual_seed(bits)).to(dtype)
    on_cpu = encode(x, bits, 256, rounding, seed=7)
    on_gpu = encode(x.cuda(), bits, 256, rounding, seed=7)
    assert on_gpu.payload.is_cuda
    assert torch.equal(on_cpu.payload, on_gpu.payload.cpu())
    assert torch.equal(decode(on_cpu), decode(on_gpu).cpu())
    restored = decode(on_gpu)
    assert restored.is_cuda and restored.dtype == dtype and restored.shape == x.shape


@pytest.mark.parametrize("make_model,make_x", [
    (SmallCNN, lambda: torch.randn(16, 3, 32, 32)),
    (TransformerBlock, lambda: torch.randn(8, 32, 64)),
])
def test_cuda_training_gradients_close_to_fp32(make_model, make_x):
    torch.manual_seed(0)
    model, x = make_model().cuda(), make_x().cuda()
    reference = gradients(model, x)
    daf.wrap(model, bits=8, min_numel=1)
    assert cosine(reference, gradients(model, x)) > 0.9995
    report = daf.report(model)
    assert report.totals()["sites"]["compressed"] > 0
    assert report.sections["store"]["pool_reserved_bytes"] > 0


def test_cuda_budget_spills_and_comes_back_exact():
    torch.manual_seed(0)
    model, x = SmallCNN().cuda(), torch.randn(16, 3, 32, 32).cuda()
    daf.wrap(model, bits=2, min_numel=1, seed=3)
    free = gradients(model, x)
    stored = daf.report(model).sections["store"]["high_water_bytes"]
    daf.unwrap(model)
    daf.wrap(model, bits=2, min_numel=1, seed=3, budget=stored // 2)
    tight = gradients(model, x)
    store = daf.report(model).sections["store"]
    assert store["spills"] > 0
    assert torch.equal(free, tight)  # spilling is lossless: same codes, same gradients
