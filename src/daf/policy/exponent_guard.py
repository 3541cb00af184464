"""Rules that hold under every bit policy: what backward exponentiates keeps 8 bits at least, and
probabilities (softmax's output, log_softmax's stored as probabilities) keep 4.

Fused attention (flash / memory-efficient kernels) saves query, key, value, its output and the
exact logsumexp of the logits; backward recomputes softmax as exp(q k^T * scale - logsumexp) and
subtracts rowsum(dO * out) from dO v^T. Coarse codes of q and k shift the logits against the exact
logsumexp, and exp() turns the shift into a multiplicative error (SmolLM2 at 2 bits diverged to NaN
in two steps): they keep 8 bits at least. Separately coded v and out break the cancellation of that
subtraction where attention is sharp: they keep 8 bits too, except where DAF remakes the output from
the records of q, k and v (the CPU kernel without dropout, ``OpCall.remakes_attention_output``): the
two then agree, and v keeps 4 bits at least. On a causal head with logits ~30, 2 bits elsewhere:
cosine to fp32 0.985 with all four at 8, 0.85 with v and a stored output at 4, 0.99 with v at 4 and
the output remade, 0.91 with v at 2 and the output remade (so v keeps ``ATTENTION_VALUE_BITS``, 4),
against NaN with 2 bits everywhere (tests/runtime/test_backward_exp.py).
The math path (used with dropout) saves its own intermediates and is left to the policy.

``log_softmax``'s output (``cross_entropy`` saves it) is the other case: its backward is
``grad - exp(output) * sum(grad)``; codes of it at 2 bits put SmolLM2's gradient 1300x off its norm.
So it is stored as codes of its probabilities (``daf.codec.logprob``), whose error backward sees as
an absolute one, and keeps ``PROBABILITY_BITS`` like softmax's output.

Softmax's own output (eager attention's probabilities, and the math path's when dropout is on) keeps
``PROBABILITY_BITS`` (4): of every kind of save in pretrained MiniLM + LoRA, its 2-bit codes cost the
most (relative error of the LoRA gradients 1.0 with them alone at 2 bits and the rest at 8; 0.29 at 4).
Under dropout the dropped map, the same size, is derived from these codes and stores nothing
(``daf.tracing.products``), so 4 bits here cost what two 2-bit maps did (docs/transformers.md).
"""

from __future__ import annotations

import torch

from daf.config import stochastic_at
from daf.format import flatten_memory_order
from daf.policy.uniform import Policy
from daf.tracing import OpCall, is_log_probabilities, stored_as_probabilities

__all__ = ["guarded_bits", "guarded_choice", "floor_bits", "floor_rule", "logit_bits", "LOGIT_WIDTHS", "LOGIT_ERROR", "SOFTMAX_RECOMPUTE_BITS", "PROBABILITY_BITS", "ATTENTION_VALUE_BITS",
           "HEAD_INPUT_BITS", "backward_exponentiates",
           "is_probability_map"]

SOFTMAX_RECOMPUTE_BITS = 8
PROBABILITY_BITS = 4
ATTENTION_VALUE_BITS = 4
# A frozen head's input, kept so that the log-probabilities are remade from it (the session's
# ``_head_remake``): the head turns its error into every logit's. SmolLM2, gradient into the head's
# input, relative error: 0.18 remade from 4-bit codes, 0.011 from 8-bit, 0.03 for the 4-bit codes of
# the probabilities themselves.
HEAD_INPUT_BITS = 8
# Fused attention's q and k: the widths tried, fewest first, and the shift of the logits their codes may
# cause (root mean square; a relative error of about as much on each probability).
LOGIT_WIDTHS = (4, 8)
LOGIT_ERROR = 0.03
_SOFTMAX_NODES = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})


def backward_exponentiates(call: OpCall | None, tensor: torch.Tensor, attention_remade: bool = True) -> bool:
    """Whether backward feeds ``tensor`` (or what it recomputes from it) to exp(), where a coarse code's
    additive error becomes a multiplicative one: fused attention's q and k (and its v and output, whose
    difference backward takes, unless the output is remade: where the call allows it and
    ``attention_remade``, the rule is in use), and log_softmax's output saved where DAF does not know the
    op (else it is coded as its probabilities: ``is_probability_map``)."""
    if call is None:  # log_softmax's output saved by an op DAF did not see: coded as it is, at 8 bits
        return is_log_probabilities(tensor)
    role = call.fused_attention_role(tensor)
    return role == "logits" or (role == "values" and not (attention_remade and call.remakes_attention_output))


def is_probability_map(tensor: torch.Tensor, call: OpCall | None = None) -> bool:
    """Whether ``tensor`` is softmax's output, or log_softmax's saved by ``call`` and stored as its
    probabilities (``daf.codec.logprob.stored_as_probabilities``)."""
    return (tensor.grad_fn is not None and type(tensor.grad_fn).__name__ in _SOFTMAX_NODES) \
        or stored_as_probabilities(tensor, call)


def floor_bits(x: torch.Tensor, op: OpCall | None = None, rounding: str = "stochastic", group_size: int = 256,
               attention_remade: bool = True) -> int:
    """The fewest bits these rules allow for ``x`` (1: no rule applies; 0: only raw will do)."""
    return floor_rule(x, op, rounding, group_size, attention_remade)[0]


def floor_rule(x: torch.Tensor, op: OpCall | None = None, rounding: str = "stochastic",
               group_size: int = 256, attention_remade: bool = True) -> tuple[int, str]:
    """``floor_bits`` and the name of the rule that sets it ("" where none applies). ``attention_remade``:
    whether the session remakes fused attention's output where the call allows (``Config.remakes``)."""
    if op is not None and op.fused_attention_role(x) == "logits" and op.attention_logits is not None:
        return logit_bits(x, op.attention_logits, rounding, group_size), "logit error bound"
    if backward_exponentiates(op, x, attention_remade):
        return SOFTMAX_RECOMPUTE_BITS, "exponentiated in backward"
    if op is not None and op.fused_attention_role(x) == "values":  # v, and the output where it is remade
        return ATTENTION_VALUE_BITS, "attention values"
    return (PROBABILITY_BITS, "probabilities") if is_probability_map(x, op) else (1, "")


def guarded_bits(policy: Policy, site: str, x: torch.Tensor, op: OpCall | None = None,
                 rounding: str = "stochastic", group_size: int = 256, attention_remade: bool = True) -> int:
    """``policy.bits_for(site, x)``, raised to ``floor_bits``: whatever the policy, these rules hold
    (a raw choice, 0 bits, stays raw; so does a save whose error bound no width meets)."""
    return guarded_choice(policy, site, x, op, rounding, group_size, attention_remade)[0]


def guarded_choice(policy: Policy, site: str, x: torch.Tensor, op: OpCall | None = None,
                   rounding: str = "stochastic", group_size: int = 256,
                   attention_remade: bool = True) -> tuple[int, str]:
    """``guarded_bits`` and why: the rule that set the width (the policy's reason, or a guard's)."""
    bits, reason = policy.choice(site, x, op)
    if not bits:
        return bits, reason
    floor, rule = floor_rule(x, op, rounding, group_size, attention_remade)
    if floor == 0:
        return 0, f"{rule}: no width meets it"
    return (floor, rule) if floor > bits else (bits, reason)


def logit_bits(x: torch.Tensor, logits: tuple[torch.Tensor, torch.Tensor, float], rounding: str,
               group_size: int) -> int:
    """The fewest bits of ``LOGIT_WIDTHS`` at which codes of ``x`` (fused attention's q or k) shift the
    logits by at most ``LOGIT_ERROR`` (root mean square), predicted from the codes' step and the other
    operand's magnitude; 0 (kept raw) where even 8 bits would shift them more.

    A logit is ``scale * sum_d q_d k_d``; an independent error of root mean square ``e`` on each of
    ``x``'s ``D`` elements shifts it by ``scale * sqrt(D) * e * rms(other)``. The error of a code is its
    group's step times 1/sqrt(12) (nearest) or at most 1/sqrt(6) (stochastic rounding). Backward
    exponentiates the logits: with the logsumexp remade from the same codes the probabilities still sum
    to one, and a shift of ``e`` is a relative error of about ``e`` on each of them.
    """
    query, key, scale = logits
    if x.numel() == 0 or not x.dtype.is_floating_point:
        return LOGIT_WIDTHS[0]
    other = key if x is query else query if x is key else None
    magnitude = max(_rms(query), _rms(key)) if other is None else _rms(other)
    step = _rms_group_range(x, group_size)
    for bits in LOGIT_WIDTHS:
        spread = (6.0 if stochastic_at(rounding, bits) else 12.0) ** -0.5
        shift = abs(scale) * x.shape[-1] ** 0.5 * step / (2**bits - 1) * spread * magnitude
        if shift <= LOGIT_ERROR:
            return bits
    return 0


def _rms(t: torch.Tensor) -> float:
    # One pass with no temporary of t's size (square().mean() wrote one: 5x the time on a q of 1.2 M elements);
    # half-precision inputs are widened first, as the sum of their squares needs.
    if not t.numel():
        return 0.0
    x = t.detach() if t.dtype in (torch.float32, torch.float64) else t.detach().float()
    return float(torch.linalg.vector_norm(x)) / t.numel() ** 0.5


def _rms_group_range(x: torch.Tensor, group_size: int) -> float:
    """Root mean square of the range of ``x``'s groups of ``group_size`` elements (memory order, as the codes
    group them; a trailing part group is left out)."""
    flat, _ = flatten_memory_order(x.detach())  # a transposed q or k without the copy reshape made
    whole = flat.numel() // group_size * group_size
    groups = (flat[:whole] if whole else flat).reshape(-1, min(group_size, flat.numel()))
    # amax and amin, not aminmax: torch.aminmax along a dimension took 13x their time on a CPU.
    return _rms(groups.amax(1).float() - groups.amin(1).float())
