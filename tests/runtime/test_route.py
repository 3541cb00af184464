"""The routing rules from a table, without hooks: ``route(tensor, context) -> Encoding``."""

import pytest
import torch

from daf.runtime import Context, Encoding, Kind, route
from daf.tracing import OpCall

W = torch.randn(64, 64, requires_grad=True)
W3 = torch.randn(4, 8, 16, requires_grad=True)
W4 = torch.randn(8, 4, 3, 3, requires_grad=True)


def _history(x: torch.Tensor) -> torch.Tensor:
    """``x`` with autograd history (a grad_fn), the values unchanged."""
    return x + 0 * W.sum()


def _changed(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return x.mul_(2)


def relu_out():
    return torch.relu(_history(torch.randn(64, 64)))


def _context(op=None, bits=2, **overrides) -> Context:
    fields = dict(site="m#0", op=op, is_parameter=False, shared=None, relu_mask=None, masks=True,
                  min_numel=16, nonzeros_only=False, bits_for=lambda site, x, op: bits)
    fields.update(overrides)
    return Context(**fields)


RELU = OpCall(torch.relu, (), {})
TABLE = [
    # (name, tensor, context, expected)
    ("parameter", lambda: W, _context(is_parameter=True), Encoding(Kind.PARAMETER)),
    ("autocast's copy of a weight, transposed", lambda: W.to(torch.bfloat16).t(), _context(), Encoding(Kind.DERIVED)),
    ("a cast of a transposed weight", lambda: W.t().to(torch.float16), _context(), Encoding(Kind.DERIVED)),
    ("a cast of a transposed 3-d weight", lambda: W3.transpose(-1, 0).to(torch.bfloat16), _context(),
     Encoding(Kind.DERIVED)),
    ("a cast of a permuted 3-d weight", lambda: W3.permute(2, 0, 1).to(torch.bfloat16).transpose(0, 1), _context(), Encoding(Kind.DERIVED)),
    ("a cast to channels_last: another memory order", lambda: W4.to(torch.bfloat16, memory_format=torch.channels_last),
     _context(), Encoding(Kind.RAW)),
    ("a cast of a reshaped weight: not replayable", lambda: W.view(32, 128).to(torch.bfloat16), _context(),
     Encoding(Kind.RAW)),
    ("a clone of the copy", lambda: W.to(torch.bfloat16).clone(), _context(), Encoding(Kind.RAW)),
    ("a copy changed since, under no_grad", lambda: _changed(W.to(torch.bfloat16)), _context(), Encoding(Kind.RAW)),
    ("relu's own save", relu_out, _context(op=RELU), Encoding(Kind.RELU_MASK, 1, "relu_mask")),
    ("relu's save, masks off", relu_out, _context(op=RELU, masks=False), Encoding(Kind.CODES, 2, "codes")),
    ("no history", lambda: torch.randn(64, 64), _context(), Encoding(Kind.RAW)),
    ("no history, made in forward, saved by a weight op", lambda: torch.randn(64, 64), _context(input_made_here=True),
     Encoding(Kind.CODES, 2, "codes")),
    ("no history, made in forward, integer", lambda: torch.arange(4096), _context(input_made_here=True),
     Encoding(Kind.RAW)),
    ("no history, two values", lambda: (torch.arange(4096) % 2).float(), _context(),
     Encoding(Kind.MASK, 1, "mask", (0.0, 1.0))),
    ("integer", lambda: torch.arange(4096), _context(), Encoding(Kind.RAW)),
    ("small", lambda: _history(torch.randn(3, 3)), _context(), Encoding(Kind.RAW)),
    ("shared", lambda: _history(torch.randn(64, 64)), _context(shared=object()), Encoding(Kind.SHARED)),
    ("two values with history", lambda: _history(torch.full((64, 64), 2.0)), _context(),
     Encoding(Kind.MASK, 1, "mask", (2.0, 2.0))),
    ("codes", lambda: _history(torch.randn(64, 64)), _context(bits=4), Encoding(Kind.CODES, 4, "codes")),
    ("the policy keeps it raw", lambda: _history(torch.randn(64, 64)), _context(bits=0), Encoding(Kind.RAW, 0)),
    ("relu output saved again, nonzeros", relu_out, _context(relu_mask=object(), nonzeros_only=True),
     Encoding(Kind.NONZEROS, 2, "codes")),
    ("float64 too small for the codes", lambda: _history(torch.randn(64, 64, dtype=torch.float64)) * 1e-60,
     _context(), Encoding(Kind.RAW)),
    ("float64 in range", lambda: _history(torch.randn(64, 64, dtype=torch.float64)), _context(),
     Encoding(Kind.CODES, 2, "codes")),
    ("relu output, policy codes all", relu_out, _context(relu_mask=object()), Encoding(Kind.CODES, 2, "codes")),
    ("relu output with a NaN stays whole", lambda: torch.relu(_history(torch.randn(64, 64))).index_fill(0, torch.tensor([3]), float("nan")),
     _context(relu_mask=object(), nonzeros_only=True), Encoding(Kind.CODES, 2, "codes")),
]


@pytest.mark.parametrize("name,make,context,expected", TABLE, ids=[row[0] for row in TABLE])
def test_route(name, make, context, expected):
    assert route(make(), context) == expected


def test_nonzeros_carry_the_positive_values_and_the_policy_sees_them():
    x = relu_out()
    seen = []
    context = _context(relu_mask=object(), nonzeros_only=True, bits_for=lambda site, data, op: seen.append(data) or 8)
    encoding = route(x, context)
    assert encoding.kind is Kind.NONZEROS and torch.equal(encoding.data, x[x > 0])
    assert seen[0] is encoding.data


def test_what_backward_exponentiates_keeps_8_bits_whatever_the_policy():
    from daf.policy.exponent_guard import guarded_bits
    from daf.policy.uniform import UniformPolicy
    logits = _history(torch.randn(8, 100))
    log_probs = torch.log_softmax(logits, -1)
    policy = UniformPolicy(2)
    assert guarded_bits(policy, "s", log_probs) == 8 and guarded_bits(policy, "s", logits) == 2
