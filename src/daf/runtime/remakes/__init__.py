"""The remake rules: saves that DAF recomputes in backward from records of the same forward instead of
storing them. Each rule is a small object with a ``name`` and ``find(tensor, op, records) -> Remake |
None``; ``Remakes`` holds them in order and the first that finds a remake decides. The session owns
one ``Remakes`` (as it owns its ``Codecs``), asks it once per save that routing may derive (rule 4 of
``daf.runtime.route``), and hands it what a rule may read of the forward (``Records``).

| rule | the save | remade from |
|---|---|---|
| ``activation`` | SiLU's or GELU's output; LayerNorm's; an elementwise RMSNorm's | the input's record (and the norm's saved statistics and weight) |
| ``attention_output`` | fused attention's output on a CPU (and its logsumexp) | q, k, v (and the mask) as kept |
| ``attention_map`` | the math path's probabilities | the scores' two operands, an exact copy of the mask |
| ``head_log_probabilities`` | log_softmax of a linear head's logits | an 8-bit record of the head's input |
| ``view`` | a reshaped view of a stored tensor (eager attention's probabilities folded for ``p @ v``) | the base's record |
| ``norm_block`` | a CNN block: act(norm(x) [+ shortcut]), batch or group norm, ReLU/SiLU/GELU | the norm input's record, its statistics and affine parameters, the shortcut's record (itself remade or stored) |

A ``Remake``'s ``bits`` is what its error is worth (the coarsest record's width; for ``norm_block`` through
an activation one bit less): routing remakes a save only where that is at least the width the policy gives
it, and keeps codes elsewhere (``daf.runtime.route.derives``; the report's ``why`` says which). Which records
a remade save reads, and what it checks in backward, each rule's module says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from daf.runtime.remakes.attention import AttentionMapRule, AttentionOutputRule
from daf.runtime.remakes.blocks import NormBlockRule, NormCalls
from daf.runtime.remakes.elementwise import ActivationRule
from daf.runtime.remakes.heads import HeadRule, LinearCalls
from daf.runtime.remakes.records import ABSENT, Records
from daf.runtime.remakes.views import ViewRule
from daf.runtime.route import Remake
from daf.tracing import OpCall

__all__ = ["Remakes", "RemakeRule", "Records", "ABSENT", "DEFAULT_RULES", "LinearCalls", "NormCalls"]


class RemakeRule(Protocol):
    name: str

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None: ...


# The order matters where two rules could take one save: a transformer's SiLU output is the activation
# rule's (from its input's record) before the block rule would walk further back.
DEFAULT_RULES: tuple[RemakeRule, ...] = (ActivationRule(), AttentionOutputRule(), AttentionMapRule(), HeadRule(),
                                         NormBlockRule(), ViewRule())


class Remakes:
    """The remake rules a session asks, in order."""

    def __init__(self, rules: Sequence[RemakeRule] = DEFAULT_RULES) -> None:
        for rule in rules:
            if not isinstance(getattr(rule, "name", None), str) or not callable(getattr(rule, "find", None)):
                raise TypeError(f"a remake rule has a name (str) and find(tensor, op, records); got {rule!r}")
        names = tuple(rule.name for rule in rules)
        if len(set(names)) != len(names):
            raise ValueError(f"remake rules need distinct names; got {list(names)}")
        self.rules = tuple(rules)
        self.names = names  # read per save (Session._bits_for): made once

    @classmethod
    def named(cls, names: Sequence[str]) -> "Remakes":
        """The default rules named in ``names`` (``Config.remakes``), in their order."""
        unknown = set(names) - {rule.name for rule in DEFAULT_RULES}
        if unknown:
            raise ValueError(f"no remake rule named {sorted(unknown)}; the rules: {[r.name for r in DEFAULT_RULES]}")
        return cls([rule for rule in DEFAULT_RULES if rule.name in names])

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        """How to remake ``tensor`` from ``records`` of this forward: the first rule's answer, or None."""
        for rule in self.rules:
            remake = rule.find(tensor, op, records)
            if remake is not None:
                return remake
        return None


