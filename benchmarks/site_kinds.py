"""Kinds of saved tensor in a transformer, and a bit policy that gives one kind fewer bits than the rest.

A save's kind comes from the class of the module it was saved in (the site is
``"<module path>#<k>"``) and from the autograd node that made it:

- ``norm``: saved inside a LayerNorm / RMSNorm module (its input, the residual stream);
- ``linear``: the input of a Linear / Conv1D / Conv2d (q, k, v, o, MLP projections, patch embedding);
- ``act``: saved inside an activation module (GELU, NewGELU, SiLU: their input);
- ``softmax``: a softmax output (eager attention's probabilities);
- ``attn``: anything else inside an attention module (the matmul operands q, k, v, scores; rotary);
- ``other``: the rest (the gating product of a gated MLP, residual adds, ConvNeXt's layer scale).

Used by ``transformer_archs.py --sites``; tests never import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from daf.policy import Policy, register_policy

__all__ = ["KINDS", "KindBits", "KindTable", "classify", "module_kinds"]

KINDS = ("norm", "linear", "act", "softmax", "attn", "other")
_LINEAR = ("Linear", "Conv1D", "Conv2d", "Conv1d")
_ACT = ("Activation", "GELU", "SiLU", "Tanh")


def _module_kind(module: nn.Module) -> str:
    name = type(module).__name__
    if "Norm" in name:
        return "norm"
    if name in _LINEAR or isinstance(module, (nn.Linear, nn.Conv2d)):
        return "linear"
    if any(a in name for a in _ACT):
        return "act"
    if "Attention" in name:
        return "attn"
    return "other"


def module_kinds(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """(module path, kind) of every named module: plain data, so that a policy config can hold it."""
    return tuple((path, _module_kind(module)) for path, module in model.named_modules() if path)


def classify(site: str, source: str, kinds: tuple[tuple[str, str], ...] | dict[str, str]) -> str:
    """The kind of the save at ``site`` made by autograd node ``source`` (``SoftmaxBackward0``...)."""
    if "Softmax" in source and "Log" not in source:
        return "softmax"
    table = kinds if isinstance(kinds, dict) else dict(kinds)
    return table.get(site.rsplit("#", 1)[0], "other")


@dataclass(frozen=True)
class KindBits:
    """Bit policy: ``low`` bits for the saves of kind ``low_kind``, ``high`` for every other."""

    low_kind: str = "none"
    low: int = 2
    high: int = 8
    kinds: tuple[tuple[str, str], ...] = ()


class _KindBitsPolicy(Policy):
    def __init__(self, config: KindBits) -> None:
        self.config = config
        self.table = dict(config.kinds)

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        source = type(x.grad_fn).__name__ if x.grad_fn is not None else ""
        kind = classify(site, source, self.table)
        return self.config.low if kind == self.config.low_kind else self.config.high

    def summary(self) -> dict:
        return {"policy": "kindbits", "low_kind": self.config.low_kind, "low": self.config.low,
                "high": self.config.high}


@register_policy(KindBits)
def _kind_bits(config) -> Policy:
    return _KindBitsPolicy(config.policy)


@dataclass(frozen=True)
class KindTable:
    """Bit policy: ``bits`` (pairs of kind and bits) for the kinds named there, ``default`` for the others."""

    bits: tuple[tuple[str, int], ...] = ()
    default: int = 2
    kinds: tuple[tuple[str, str], ...] = ()


class _KindTablePolicy(Policy):
    def __init__(self, config: KindTable) -> None:
        self.config, self.table, self.bits = config, dict(config.kinds), dict(config.bits)

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        source = type(x.grad_fn).__name__ if x.grad_fn is not None else ""
        return self.bits.get(classify(site, source, self.table), self.config.default)

    def summary(self) -> dict:
        return {"policy": "kindtable", "bits": dict(self.config.bits), "default": self.config.default}


@register_policy(KindTable)
def _kind_table(config) -> Policy:
    return _KindTablePolicy(config.policy)
