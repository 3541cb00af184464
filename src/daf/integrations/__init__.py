"""DAF in the training frameworks people use: ``daf.integrations.transformers.DAFCallback`` (Hugging Face
``Trainer``) and ``daf.integrations.lightning.DAFCallback`` (Lightning ``Trainer``).

Each lives in its own module and imports its framework there: ``import daf`` never imports
``transformers`` or ``lightning`` (they are optional: DAF's ``integrations`` extra installs them).
See docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from daf import api
from daf.config import Config
from daf.runtime import Session

__all__ = ["figures", "Wrapping", "WrappingCallback"]


def figures(session: Session, prefix: str = "daf/") -> dict[str, float]:
    """What the frameworks log: bytes the last forward's saved tensors would have held (``raw_bytes``),
    bytes DAF held (``stored_bytes``), their ratio, and the last gradient audit's cosine (``audit_cosine``,
    once an audit ran: docs/audit.md)."""
    report = session.report()
    out = {f"{prefix}raw_bytes": float(report.raw_bytes), f"{prefix}stored_bytes": float(report.stored_bytes),
           f"{prefix}ratio": float(report.ratio)}
    cosine = report.sections.get("audit", {}).get("cosine")
    if cosine is not None:
        out[f"{prefix}audit_cosine"] = float(cosine)
    return out


class Wrapping:
    """Wraps a model when training begins, unless it is wrapped already, and unwraps it when training
    ends if it wrapped it. ``session`` stays readable after (``daf.report(callback.session)``)."""

    def __init__(self, config: Config | None = None, **overrides: Any) -> None:
        self.config = api._config(config, overrides)  # validated now: a bad option fails at construction
        self.session: Session | None = None
        self._wrapped: nn.Module | None = None

    def begin(self, model: nn.Module) -> Session:
        if getattr(model, api._ATTR, None) is None:
            api.wrap(model, self.config)
            self._wrapped = model
        self.session = api.session_of(model)
        return self.session

    def end(self) -> None:
        if self._wrapped is not None:
            api.unwrap(self._wrapped)
            self._wrapped = None

    def figures(self) -> dict[str, float]:
        return figures(self.session) if self.session is not None else {}


class WrappingCallback:
    """What both frameworks' callbacks share: the ``Wrapping`` built from ``daf.wrap``'s arguments, and
    its ``session`` (``daf.report(callback.session)`` after training)."""

    def __init__(self, config: Config | None = None, **overrides: Any) -> None:
        self._wrapping = Wrapping(config, **overrides)

    @property
    def session(self) -> Session | None:
        return self._wrapping.session
