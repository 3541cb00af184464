"""The report rows of a forward: what each saved tensor would have cost and what it costs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from daf.report import Report, SiteRow
from daf.runtime.route import Encoding, Kind
from daf.tracing import TensorTable, tensor_key

__all__ = ["Accounting"]

_ROW_KIND = {Kind.RAW: "raw", Kind.SHARED: "shared", Kind.MASK: "mask", Kind.RELU_MASK: "mask",
             Kind.REGION_MASK: "mask",
             Kind.NONZEROS: "compressed", Kind.CODES: "compressed", Kind.DERIVED: "derived"}


class Accounting:
    """Rows of the forward in progress and of the last finished one.

    ReLU's output is stored twice (a mask for ReLU, codes for the next op) but autograd without
    DAF would hold it once: the last row that saves a tensor counts its raw bytes. A tensor kept raw
    counts once, however many views of it are saved (rotary's cos and sin, saved by each layer's
    multiplies through a view made in that layer): a kept tensor lives until backward, so its
    address is not reused within the forward.
    """

    def __init__(self) -> None:
        self._rows: list[SiteRow] = []
        self._last: list[SiteRow] = []
        self._counted = TensorTable(check_version=False)
        self._kept_raw: set[tuple] = set()
        self.parameters_referenced = 0

    def begin(self) -> None:
        self._rows = []
        self._counted.clear()
        self._kept_raw.clear()
        self.parameters_referenced = 0

    def end(self) -> None:
        self._last = self._rows

    def add(self, site: str, tensor: torch.Tensor, encoding: Encoding, stored: int, why: str = "") -> int:
        """Count one save; returns its row number (for ``fill``), -1 for a parameter (no row)."""
        if encoding.kind is Kind.PARAMETER:
            self.parameters_referenced += 1
            return -1
        raw = 0 if encoding.kind is Kind.SHARED else tensor.numel() * tensor.element_size()
        if encoding.kind is Kind.RAW:
            key = tensor_key(tensor)
            if key in self._kept_raw:
                raw = stored = 0
            self._kept_raw.add(key)
        if raw:
            earlier = self._counted.get(tensor)
            if earlier is not None:
                self._rows[earlier] = replace(self._rows[earlier], raw_bytes=0)
            self._counted.put(tensor, len(self._rows))
        source = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "no history"
        self._rows.append(SiteRow(site, source, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                  encoding.bits if encoding.kind.stored else None, raw, stored,
                                  _ROW_KIND[encoding.kind], why))
        return len(self._rows) - 1

    def add_unsaved(self, site: str, tensor: torch.Tensor, bits: int, stored: int) -> None:
        """Count a record DAF keeps of a tensor autograd does not save (a frozen head's input, which the
        log-probabilities are remade from): its stored bytes, no raw bytes."""
        source = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "no history"
        self._rows.append(SiteRow(site, source, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                  bits, 0, stored, "compressed"))

    def fill(self, row: int, site: str, stored: int, kind: str | None = None, why: str | None = None) -> None:
        """The stored bytes of a row packed in the background (or held), once known; or of a raw row whose
        tensor is remade after all (``kind`` "derived": fused attention's logsumexp, once its output is
        remade); a held norm input split by a ReLU mask says so in ``why``."""
        if 0 <= row < len(self._rows) and self._rows[row].site == site:
            current = self._rows[row]
            self._rows[row] = replace(current, stored_bytes=stored, kind=kind or current.kind,
                                      why=current.why if why is None else why)

    def report(self, sections: dict[str, Any], forward: int | None) -> Report:
        """Figures of the last finished forward (number ``forward``)."""
        return Report(list(self._last), self.parameters_referenced, sections, forward)
