"""What DAF stored during the last forward: per-site rows, totals, and each component's figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SiteRow", "Report"]


@dataclass(frozen=True)
class SiteRow:
    """One tensor saved for backward.

    ``kind`` is "compressed", "mask" (stored exactly as one bit per element: ReLU's own
    saved output, dropout masks and other two-valued tensors; ``bits`` is 1), "raw" (kept
    as it is: too small, not floating point, or the policy chose so), "shared" (the
    same tensor saved again by another op; stored once, so its bytes count zero here) or "derived"
    (nothing stored: autocast's cast of a parameter, recast from the parameter in backward; dropout's
    output, remade from the stored input and its exact mask; an activation's, a norm's or attention's
    output or probabilities, an LM's log-probabilities, remade from other records; its raw bytes are
    the copy that autograd would have kept).

    One row is not a save: ``<site>.head_input``, the record of a frozen head's input that the
    log-probabilities saved at ``<site>`` are remade from, "compressed" with its stored bytes and no raw
    bytes (autograd would not have kept it).
    """

    site: str
    source: str
    shape: tuple[int, ...]
    dtype: str
    bits: int | None
    raw_bytes: int
    stored_bytes: int
    kind: str
    why: str = ""  # the rule that gave a coded save its width (or kept it raw)


@dataclass
class Report:
    """Activation memory of the last forward of a wrapped model. ``str(report)`` is a table."""

    rows: list[SiteRow] = field(default_factory=list)
    parameters_referenced: int = 0
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    # which forward the rows describe (0 is the first, counted by the session); None before any
    forward: int | None = None

    @property
    def raw_bytes(self) -> int:
        """Bytes the saved tensors would have held in their own dtype (fp32/fp16/...) without DAF."""
        return sum(r.raw_bytes for r in self.rows)

    @property
    def stored_bytes(self) -> int:
        """Bytes actually held: codes plus metadata of compressed tensors, plus tensors kept raw."""
        return sum(r.stored_bytes for r in self.rows)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def compressed_ratio(self) -> float:
        """The ratio over compressed sites only (what the codec achieves where it applies)."""
        rows = [r for r in self.rows if r.kind == "compressed"]
        stored = sum(r.stored_bytes for r in rows)
        return sum(r.raw_bytes for r in rows) / stored if stored else 1.0

    @property
    def mean_code_bits(self) -> float | None:
        """Bits per element over the coded tensors (rows of kind "compressed"), each weighted by its
        elements: what "an average of B bits" means for the codes. Masks, raw, shared and derived rows are
        not in it (see their own rows); None when nothing was coded."""
        rows = [r for r in self.rows if r.kind == "compressed" and r.bits is not None]
        elements = [math.prod(r.shape) for r in rows]
        return sum(n * r.bits for n, r in zip(elements, rows)) / sum(elements) if sum(elements) else None

    def totals(self) -> dict[str, Any]:
        counts = {kind: sum(r.kind == kind for r in self.rows)
                  for kind in ("compressed", "mask", "raw", "shared", "derived")}
        return {"raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes, "ratio": self.ratio,
                "mean_code_bits": self.mean_code_bits, "sites": counts,
                "parameters_referenced": self.parameters_referenced, "forward": self.forward}

    def to_dict(self) -> dict[str, Any]:
        return {"totals": self.totals(), "rows": [r.__dict__ for r in self.rows], "sections": self.sections}

    def __str__(self) -> str:
        header = ("site", "source", "shape", "dtype", "bits", "raw", "stored", "kind", "why")
        lines = [header] + [
            (r.site, r.source, "x".join(map(str, r.shape)) or "scalar", r.dtype,
             "-" if r.bits is None else str(r.bits), _size(r.raw_bytes), _size(r.stored_bytes), r.kind, r.why)
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
        text.append("")
        if self.forward is None and not self.rows:
            text.append("no forward seen yet in training mode with grad enabled: nothing was compressed")
        derived = sum(r.kind == "derived" for r in self.rows)
        text.append(f"{'' if self.forward is None else f'forward {self.forward}: '}activations: {_size(self.raw_bytes)} raw -> {_size(self.stored_bytes)} stored "
                    f"({self.ratio:.1f}x; {self.compressed_ratio:.1f}x on compressed sites); "
                    f"{self.parameters_referenced} parameter tensors referenced, not copied"
                    + (f"; {self.mean_code_bits:.2f} bits per coded element" if self.mean_code_bits else "")
                    + (f"; derived in backward, not kept (casts of parameters, dropout outputs, SiLU/GELU/LayerNorm outputs): {derived}"
                       if derived else ""))
        for name, figures in self.sections.items():
            text.append(f"{name}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in figures.items()))
        return "\n".join(text)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
