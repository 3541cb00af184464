"""Rule ``view``: a reshaped view of a tensor this forward stored, remade by reshaping its record.

Eager attention stores softmax's probabilities (8 bits, ``SENSITIVE_NODES``) and its product with v saves
them again, folded to three dimensions by ``matmul`` (a view of the same elements): without this rule the
view was coded a second time, at 4 bits, and ``dV = p^T dO`` read the coarser copy. Taken only where the
view is the whole of a contiguous base in the same order (a reshape), so that reshaping the decoded base
gives its elements exactly where the view had them. The error is the base record's."""

from __future__ import annotations

import functools

import torch

from daf.runtime.remakes.records import Records
from daf.runtime.route import Remake
from daf.tracing import OpCall

__all__ = ["ViewRule"]


class ViewRule:
    name = "view"

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        base = tensor._base
        if base is None or base.grad_fn is None or not _reshape_of(tensor, base):
            return None
        record = records.record_of(base.grad_fn, base.output_nr)
        if record is None:
            return None
        return Remake((record,), functools.partial(_reshaped, shape=tuple(tensor.shape)), record.bits, rule=self.name,
                      why=f"{self.name}: remade from {record.site} (reshaped)")


def _reshape_of(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` holds every element of ``base`` in its order: both contiguous, same start and count."""
    return (view.numel() == base.numel() and view.data_ptr() == base.data_ptr() and view.dtype == base.dtype
            and view.is_contiguous() and base.is_contiguous())


def _reshaped(decoded: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return decoded.reshape(shape)
