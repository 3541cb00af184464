"""The uniform bit policy: every compressible site gets ``Config.bits``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Policy", "UniformPolicy"]


class Policy:
    """What the runtime asks of a bit policy. Subclasses override what they need."""

    # Whether the codes of a ReLU output saved by a later op may cover its nonzeros only (its zeros
    # come exactly from ReLU's own 1-bit mask): the session then passes that op's save to
    # ``bits_for``, ``watch`` and the codec as the 1-D tensor of the nonzeros.
    codes_nonzeros_only = False

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        """Bits for the tensor saved at ``site``; 0 keeps it raw."""
        raise NotImplementedError

    def bits_for_call(self, site: str, x: torch.Tensor, op: Any) -> int:
        """``bits_for``, for a policy that also reads the saving call (a ``daf.tracing.OpCall`` or None)."""
        return self.bits_for(site, x)

    def reason(self, x: torch.Tensor, op: Any) -> str:
        """Why ``bits_for_call`` gives ``x`` its width, for the report: the policy's name by default."""
        return str(self.summary().get("policy", type(self).__name__))

    def choice(self, site: str, x: torch.Tensor, op: Any) -> tuple[int, str]:
        """``(bits_for_call, reason)``: what the runtime asks once per save. A policy whose two answers share
        their checks overrides it to make them once."""
        return self.bits_for_call(site, x, op), self.reason(x, op)

    def importance(self, site: str, order: int) -> float:
        """Larger is more important. Stand-in: the pack order, so the activations that
        backward needs last (saved first) are the first candidates for demotion and spill."""
        return float(order)

    def on_forward_start(self, step: int) -> None:
        """Called before each compressed forward, with the number of forwards so far."""

    def watch(self, site: str, x: torch.Tensor, bits: int, elements: int | None = None, derived: bool = False) -> None:
        """Called for every compressed tensor; a policy may hook gradients here. ``elements``: the
        activation's element count when ``x`` holds only its nonzeros (``codes_nonzeros_only``);
        ``derived``: nothing is stored, the tensor is remade from records ``bits`` wide."""

    def watch_op(self, call: Any) -> None:
        """Called after each torch function that saved stored tensors
        (a ``daf.tracing.OpCall``: the function, its arguments, output, and the saves)."""

    def close(self) -> None:
        """Release what the policy holds outside itself (hooks); called when the session closes."""

    def summary(self) -> dict[str, Any]:
        return {}


class UniformPolicy(Policy):
    def __init__(self, bits: int) -> None:
        self.bits = bits

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self.bits

    def summary(self) -> dict[str, Any]:
        return {"policy": "uniform", "bits": self.bits}
