"""A rule that holds under every bit policy: what backward exponentiates keeps 8 bits at least.

Fused attention (flash / memory-efficient kernels) saves query, key, value, its output and the
exact logsumexp of the logits; backward recomputes softmax as exp(q k^T * scale - logsumexp) and
subtracts rowsum(dO * out) from dO v^T. Coarse codes of q and k shift the logits against the exact
logsumexp, and exp() turns the shift into a multiplicative error (SmolLM2 at 2 bits diverged to NaN
in two steps); coarse v and out break the cancellation of that subtraction where attention is
sharp. All four keep 8 bits at least: on a causal head with logits ~30, 2 bits elsewhere and 8 here
gives gradients at cosine 0.985 to fp32, against NaN with 2 bits here (tests/runtime/test_backward_exp.py).
The math path (used with dropout) saves its own intermediates and is left to the policy.

``log_softmax``'s output (``cross_entropy`` saves it) is the other case: its backward is
``grad - exp(output) * sum(grad)``; at 2 bits SmolLM2's gradient was off by 1300x its norm.
"""

from __future__ import annotations

import torch

from daf.policy.uniform import Policy
from daf.tracing import OpCall

__all__ = ["guarded_bits", "SOFTMAX_RECOMPUTE_BITS", "backward_exponentiates"]

SOFTMAX_RECOMPUTE_BITS = 8


def backward_exponentiates(call: OpCall | None, tensor: torch.Tensor) -> bool:
    """Whether backward feeds ``tensor`` (or what it recomputes from it) to exp(), where a coarse code's
    additive error becomes a multiplicative one: fused attention's saves and log_softmax's output."""
    if tensor.grad_fn is not None and type(tensor.grad_fn).__name__ == "LogSoftmaxBackward0":
        return True
    return call is not None and call.is_fused_attention_save(tensor)


def guarded_bits(policy: Policy, site: str, x: torch.Tensor, op: OpCall | None = None) -> int:
    """``policy.bits_for(site, x)``, raised to SOFTMAX_RECOMPUTE_BITS where backward exponentiates:
    whatever the policy, this rule holds."""
    bits = policy.bits_for(site, x)
    if bits and backward_exponentiates(op, x):
        return max(bits, SOFTMAX_RECOMPUTE_BITS)
    return bits
