"""Gradients with compressed activations against fp32 on the same batch.

Figures seen when these thresholds were set (seed 0, cosine similarity of all
parameter gradients against fp32; stochastic rounding, group 256):
    MLP          8 bits 0.99996   2 bits 0.823
    small CNN    8 bits 0.99994   2 bits 0.664  (ReLU masks and BatchNorm are the weak spots)
    transformer  8 bits 0.99999   2 bits 0.948
"""

import pytest
import torch

import daf
from tests.models import SmallCNN, TransformerBlock, cosine, gradients, mlp

CASES = {
    "mlp": (mlp, lambda: torch.randn(128, 64), lambda: torch.randint(0, 10, (128,)), 0.75),
    "cnn": (SmallCNN, lambda: torch.randn(16, 3, 32, 32), lambda: torch.randint(0, 10, (16,)), 0.55),
    "transformer": (TransformerBlock, lambda: torch.randn(8, 32, 64), lambda: None, 0.9),
}


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_fp32(name):
    make_model, make_x, make_y, floor_2bit = CASES[name]
    torch.manual_seed(0)
    model, x, y = make_model(), make_x(), make_y()
    reference = gradients(model, x, y)
    daf.wrap(model, bits=8, min_numel=1)
    assert cosine(reference, gradients(model, x, y)) > 0.9995
    daf.unwrap(model)
    daf.wrap(model, bits=2, min_numel=1)
    two_bit = gradients(model, x, y)
    assert cosine(reference, two_bit) > floor_2bit
    assert daf.report(model).compressed_ratio > 12


def test_fp32_gradients_are_untouched_after_unwrap():
    torch.manual_seed(0)
    model, x = TransformerBlock(), torch.randn(2, 8, 64)
    before = gradients(model, x)
    daf.unwrap(daf.wrap(model))
    assert torch.equal(before, gradients(model, x))
