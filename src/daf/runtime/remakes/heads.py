"""Rule ``head_log_probabilities``: log-probabilities of a linear's output (an LM's head) whose input is
alive, remade from an 8-bit record of that input (``HeadInput``, coded by the session only if routing
derives them). Not when the logits were changed in place between the head and log_softmax
(``logits_unchanged``); raises in backward where the head's weight or bias changed since
(``head_log_probabilities``). ``LinearCalls`` is the table of this forward's linear calls it reads."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from daf.policy.exponent_guard import HEAD_INPUT_BITS
from daf.runtime.records import HeadInput
from daf.runtime.remakes.records import Records
from daf.runtime.route import Remake, compressible
from daf.tracing import OpCall, head_log_probabilities, nodes_behind
from daf.tracing.log_probabilities import logits_unchanged

__all__ = ["HeadRule", "LinearCalls"]


class LinearCalls:
    """Linear calls of one forward by their output's node: (node, weakref to the input, its version, weight,
    bias, (weakref to the output, its version))."""

    def __init__(self) -> None:
        self._calls: dict[tuple[int, int], tuple[Any, weakref.ref, int, torch.Tensor, torch.Tensor | None,
                                                  tuple[weakref.ref, int]]] = {}

    def note(self, call: OpCall) -> None:
        if call.func is not F.linear or not isinstance(call.output, torch.Tensor) or call.output.grad_fn is None:
            return
        arguments = [*call.args, None, None][:3]
        y = call.kwargs.get("input", arguments[0])
        weight, bias = call.kwargs.get("weight", arguments[1]), call.kwargs.get("bias", arguments[2])
        if isinstance(y, torch.Tensor) and isinstance(weight, torch.Tensor):
            node, logits = call.output.grad_fn, call.output
            self._calls[(id(node), logits.output_nr)] = (node, weakref.ref(y), y._version, weight, bias,
                                                         (weakref.ref(logits), logits._version))

    def get(self, node: Any, output_nr: int) -> tuple | None:
        entry = self._calls.get((id(node), output_nr))
        return entry if entry is not None and entry[0] is node else None

    def clear(self) -> None:
        self._calls.clear()


class HeadRule:
    name = "head_log_probabilities"

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        for node, output_nr in nodes_behind(tensor):
            entry = records.linears.get(node, output_nr)
            if entry is not None:
                break
        else:
            return None
        _, input_ref, version, weight, bias, logits = entry
        y = input_ref()
        if y is None or y._version != version or not compressible(y, records.min_numel):
            return None  # gone, or changed in place since the head read it
        if not logits_unchanged(tensor, op, logits[0](), logits[1]):
            return None
        versions = (weight._version, None if bias is None else bias._version)
        function = functools.partial(head_log_probabilities, weight=weight, bias=bias, versions=versions,
                                     shape=tuple(tensor.shape), dtype=tensor.dtype)
        return Remake((HeadInput(y),), function, HEAD_INPUT_BITS,
                      rule=self.name, why=f"{self.name}: remade from an {HEAD_INPUT_BITS}-bit record of the head's input")
