"""Which saves are log_softmax's output, and which of them DAF stores as codes of their probabilities.

Cross-entropy's backward reads the saved log-probabilities only through ``exp`` (``log_softmax``'s
backward is ``grad - exp(y) * sum(grad)``; ``nll_loss``'s reads only their shape), so those saves may
hold ``log(p')`` with ``p'`` the decoded probabilities, ``-inf`` where one codes to 0
(``daf.codec.logprob``). An op that reads the values themselves must not see that. Here, not in the
codec, because routing and the exponent guard ask too.
"""

from __future__ import annotations

import torch

from daf.format import FLOAT_DTYPES
from daf.tracing.ops import OpCall

__all__ = ["READERS", "is_log_probabilities", "stored_as_probabilities"]

# Ops whose backward reads saved log-probabilities through exp() (log_softmax, cross_entropy) or
# only for their shape (nll_loss): they may share the record, -inf and all.
READERS = frozenset({"log_softmax", "cross_entropy", "nll_loss"})


def is_log_probabilities(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``log_softmax``'s output (a floating-point one with its autograd node)."""
    return (tensor.grad_fn is not None and type(tensor.grad_fn).__name__ == "LogSoftmaxBackward0"
            and tensor.dtype in FLOAT_DTYPES)


def stored_as_probabilities(tensor: torch.Tensor, op: OpCall | None) -> bool:
    """Whether this save of ``tensor`` is stored as codes of its probabilities: log_softmax's output
    saved by one of ``READERS``. Saved by another op, it is coded as it is (that op may read the
    values); by an op DAF did not see, too (``daf.policy.exponent_guard`` then keeps 8 bits)."""
    return op is not None and op.name in READERS and is_log_probabilities(tensor)
