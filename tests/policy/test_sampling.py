"""The importance estimator's measurements: batched figures equal one-by-one ones."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daf.policy.sampling import batched_rounding_variance, group_sample, rounding_variance

CHOICES = (1, 2, 4, 8)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.floats(1e-3, 1e3), st.booleans(), st.booleans()),
                min_size=1, max_size=5))
def test_batched_rounding_variance_equals_one_sample_at_a_time(specs):
    generator = torch.Generator().manual_seed(len(specs))
    tensors = []
    for groups, scale, transposed, infinite in specs:
        x = torch.randn(groups * 64, 4, generator=generator) * scale
        if infinite:
            x[0, 0] = math.inf  # the first group's range is not finite: left out
        tensors.append(x.t() if transposed else x)
    batched = batched_rounding_variance([group_sample(x, 256, 64) for x in tensors], CHOICES)
    for x, (variance, data_var) in zip(tensors, batched):
        expected, expected_var = rounding_variance(x, 256, CHOICES)
        assert torch.allclose(variance, expected, rtol=1e-9, atol=0), (variance, expected)
        assert math.isclose(data_var, expected_var, rel_tol=1e-9, abs_tol=1e-12)


def test_a_transposed_tensor_is_sampled_in_memory_order_without_a_copy_of_it():
    x = torch.arange(4096, dtype=torch.float32).view(64, 64).t()  # memory order: 0, 1, 2, ...
    sample = group_sample(x, 256, 4)
    assert torch.equal(sample[0], torch.arange(256, dtype=torch.float32))
    assert sample.shape == (4, 256)
