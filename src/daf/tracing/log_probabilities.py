"""Which saves are log_softmax's output, and which of them DAF stores as codes of their probabilities.

Cross-entropy's backward reads the saved log-probabilities only through ``exp`` (``log_softmax``'s
backward is ``grad - exp(y) * sum(grad)``; ``nll_loss``'s reads only their shape), so those saves may
hold ``log(p')`` with ``p'`` the decoded probabilities, ``-inf`` where one codes to 0
(``daf.codec.logprob``). An op that reads the values themselves must not see that. Here, not in the
codec, because routing and the exponent guard ask too.

A language model's log-probabilities are as large as tokens x vocabulary (SmolLM2: 49,152 per token)
and are made from a frozen head's input of tokens x hidden size (576): ``log_softmax(linear(y))``.
``head_log_probabilities`` remakes them from a record of ``y`` in backward (the session keeps ``y`` at
8 bits, ``daf.policy.exponent_guard.HEAD_INPUT_BITS``), and ``nodes_behind`` names the nodes between
the log-probabilities and the linear's output (a flattening view, a cast to float32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from daf.format import FLOAT_DTYPES
from daf.tracing.ops import OpCall
from daf.tracing.products import over_last_dimension

__all__ = ["READERS", "is_log_probabilities", "stored_as_probabilities", "nodes_behind", "head_log_probabilities",
           "logits_unchanged"]

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


# What may stand between a linear's output and log_softmax without changing an element's place: views
# that keep row-major order, and casts (HF's loss upcasts the logits).
_PASSING = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ToCopyBackward0"})


def nodes_behind(tensor: torch.Tensor, most: int = 4) -> list[tuple[Any, int]]:
    """(node, output number) of each node from log_softmax's input back through views and casts,
    nearest first: where the linear whose output it is may be found. Empty for anything but
    log_softmax's output over its last dimension."""
    node = tensor.grad_fn if is_log_probabilities(tensor) else None
    if node is None or not over_last_dimension(node, tensor):
        return []
    found: list[tuple[Any, int]] = []
    edge = node.next_functions[0]
    while edge[0] is not None and len(found) < most:
        found.append(edge)
        if type(edge[0]).__name__ not in _PASSING:
            break
        edge = edge[0].next_functions[0]
    return found


def head_log_probabilities(y: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None,
                           versions: tuple[int, int | None], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``log_softmax(linear(y, weight, bias))`` as ``shape`` and ``dtype``: the log-probabilities from the
    head's decoded input. Raises where the head's weight or bias changed in place since forward (an
    optimizer step before backward), as plain autograd does for the weight it saves."""
    for name, tensor, version in zip(("weight", "bias"), (weight, bias), versions):
        if tensor is not None and tensor._version != version:
            raise RuntimeError(
                f"DAF: the {name} [{tensor.type()} {list(tensor.shape)}] of the linear whose log-probabilities DAF "
                f"remakes in backward was modified in place since forward (version {tensor._version}, {version} "
                f"then); plain PyTorch raises here too. Change parameters after backward.")
    logits = F.linear(y, weight, bias).to(dtype).reshape(shape)
    return logits.log_softmax(-1)


def logits_unchanged(tensor: torch.Tensor, op: OpCall | None, output: torch.Tensor | None, version: int) -> bool:
    """Whether what log_softmax read to make ``tensor`` is what the head wrote: no in-place change (a
    vocabulary barred to -inf under no_grad) of the head's ``output`` (alive, at its ``version`` of the head's
    call), nor of the cast or view between them (a cast is born at version 0; a view shares its base's
    counter). The remake recomputes the head's output, so a change not seen here would be lost. The tensor
    log_softmax read is known from the call that made ``tensor`` (``op``: log_softmax or cross_entropy);
    where it is not, only views, all on the head's output's counter, may stand between. O(1)."""
    if output is None or output._version != version:
        return False
    behind = nodes_behind(tensor)
    read = op.args[0] if op is not None and op.args and isinstance(op.args[0], torch.Tensor) else None
    if read is None or not behind or (read.grad_fn, read.output_nr) != behind[0]:
        return all(type(node).__name__ != "ToCopyBackward0" for node, _ in behind)
    shares_counter = _base_of(read) is _base_of(output)
    return read._version == (version if shares_counter else 0)


def _base_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._base if tensor._base is not None else tensor
