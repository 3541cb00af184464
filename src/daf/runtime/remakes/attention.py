"""Rules ``attention_output`` and ``attention_map``: fused attention's output on a CPU remade with its
logsumexp from the records of q, k, v (and the mask) by running the kernel again; the math path's
probabilities from the records of the scores' two operands and an exact copy of the call's mask taken in
forward (``daf.runtime.snapshots``). Recognizers in ``daf.tracing.products``."""

from __future__ import annotations

import torch

from daf.runtime.records import remake_from
from daf.runtime.remakes.records import ABSENT, Records
from daf.runtime.route import Remake
from daf.tracing import OpCall, attention_map_of, attention_output_of

__all__ = ["AttentionOutputRule", "AttentionMapRule"]


class AttentionOutputRule:
    name = "attention_output"

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        attention = attention_output_of(tensor)
        if attention is None:
            return None
        found = [records.record_behind(attention.node, attribute) for attribute in attention.attributes]
        mask = records.record_behind(attention.node, attention.mask_attribute)
        if mask is not ABSENT:
            found.append(mask)
        return remake_from(found, attention.function, with_statistic=True,
                           rule=self.name, why=f"{self.name}: remade from q, k, v as kept")


class AttentionMapRule:
    name = "attention_map"

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        arguments = op.attention_arguments if op is not None else None
        if arguments is None:
            return None
        probabilities = attention_map_of(tensor, *arguments, hold=records.hold_mask)
        if probabilities is None:
            return None
        return remake_from([records.record_behind(probabilities.node, a) for a in probabilities.attributes],
                           probabilities.function, rule=self.name, why=f"{self.name}: remade from the scores' operands")
