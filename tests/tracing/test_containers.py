"""Functions that are a sequence of torch calls (``F.multi_head_attention_forward``) are traced call by call:
the fused attention inside ``nn.MultiheadAttention`` is seen as such (its q and k under the exponent guard,
its output remade), and the gradient is autograd's where the codes are exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daf


def _layer(large: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
    if large:  # trained models' large channels, as benchmarks/default_safety.py makes them
        with torch.no_grad():
            layer.norm1.weight[:2] *= 60
    return layer


def _gradient(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_multihead_attentions_fused_attention_is_seen_inside_it():
    layer = daf.wrap(_layer(), audit=daf.Audit(every=0))
    _gradient(layer, torch.randn(4, 32, 64))
    rows = {row.site: row for row in daf.report(layer).rows}
    assert rows["self_attn#2"].why == rows["self_attn#3"].why == "logit error bound"  # q and k: the guard
    assert rows["self_attn#6"].kind == "derived"  # the output, remade from q, k, v


@pytest.mark.parametrize("large", [False, True])
def test_multihead_attention_with_large_channels_keeps_its_gradient(large):
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1))
    expected = _gradient(_layer(large), x)
    got = _gradient(daf.wrap(_layer(large), audit=daf.Audit(every=0)), x)
    assert F.cosine_similarity(got, expected, 0) > 0.98  # q and k were 4-bit codes behind the container


def test_the_body_is_the_function_without_its_handler_check():
    from daf.tracing.ops import CONTAINER_FUNCTIONS, body_of
    [func] = CONTAINER_FUNCTIONS
    body = body_of(func)
    assert body.__code__ is func.__code__ and body.__defaults__ == func.__defaults__
    assert body.__globals__["has_torch_function"](()) is False and func.__globals__["has_torch_function"] is not \
        body.__globals__["has_torch_function"]


def test_a_container_called_inside_another_op_is_left_whole():
    # need_weights=True takes the explicit path: still traced call by call, and the gradients agree at 8 bits
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(2, 16, 64)
    expected = torch.autograd.grad(attention(x, x, x)[0].sum(), list(attention.parameters()))
    daf.wrap(attention, bits=8, rounding="nearest", audit=daf.Audit(every=0))
    got = torch.autograd.grad(attention(x, x, x)[0].sum(), list(attention.parameters()))
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    assert F.cosine_similarity(flat(got), flat(expected), 0) > 0.999


def test_a_function_without_the_check_by_that_name_is_its_own_body():
    from daf.tracing.ops import body_of

    def plain(x):
        return x + 1

    assert body_of(plain) is plain
