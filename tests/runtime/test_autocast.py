"""Under autocast, the bf16 copies of the weights are kept as they are, not quantized.

Autocast casts each weight to bfloat16 before a matmul and autograd saves that copy (a
``ToCopyBackward0`` of the parameter, then a transpose). It is a weight, not an activation:
its codes would multiply every input gradient of the layer.
"""

import copy

import torch
from torch import nn

import daf


def _grads(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().square().sum().backward()
    return torch.cat([p.grad.flatten().float() for p in model.parameters()])


def test_weight_copies_are_kept_and_the_gradient_stays_close():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.LayerNorm(512),
                          nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    x = torch.randn(256, 256)
    model = daf.wrap(copy.deepcopy(plain), bits=2)
    cosine = torch.nn.functional.cosine_similarity(_grads(model, x), _grads(plain, x), dim=0)
    assert cosine > 0.93  # 0.88 when the weight copies were quantized at 2 bits
    copies = [r for r in daf.report(model).rows if r.source == "TBackward0"]
    assert len(copies) == 3 and all(r.kind == "raw" and r.dtype == "bfloat16" for r in copies)


def test_views_of_a_parameter_are_still_referenced_without_autocast():
    model = daf.wrap(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)), bits=2)
    model(torch.randn(128, 64)).sum().backward()
    report = daf.report(model)
    assert report.parameters_referenced == 1 and not any(r.source == "TBackward0" for r in report.rows)
