"""Rule ``activation``: SiLU's or GELU's output, LayerNorm's, or an elementwise RMSNorm's, remade from its
input's record (``daf.tracing.products``: the norm's saved statistics and weight held by the function).
The error is the record's through the function (|f'| <= 1.13 for the activations)."""

from __future__ import annotations

import torch

from daf.runtime.remakes.records import Records
from daf.runtime.route import Remake
from daf.tracing import OpCall, activation_output_of, normalized_output_of, rms_normalized_output_of

__all__ = ["ActivationRule"]


class ActivationRule:
    name = "activation"

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        found = (activation_output_of(tensor) or normalized_output_of(tensor, records.readable)
                 or rms_normalized_output_of(tensor, records.readable))
        if found is None:
            return None
        x = records.record_of(found.node, found.output_nr)
        if x is None:
            return None
        return Remake((x,), found.function, x.bits, rule=self.name, why=f"{self.name}: remade from {x.site}",
                      made_by=found.made_by)
