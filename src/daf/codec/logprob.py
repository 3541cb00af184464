"""``log_softmax``'s output stored as codes of its probabilities, decoded back to their logarithm.

Cross-entropy saves the log-probabilities ``y = log_softmax(z)``, and their backward is
``grad - exp(y) * sum(grad)``: it reads ``y`` only through ``exp``. Codes of ``y`` itself put an
additive error on ``y``, which ``exp`` turns into a multiplicative one on every probability (2 bits:
SmolLM2's gradient 1300x off its norm), so those codes needed 8 bits. Codes of ``p = exp(y)`` put
the error where backward uses it, as an absolute error on ``p`` (unbiased under stochastic
rounding), and decoding ``log(p')`` gives backward ``exp(log(p')) = p'``. On SmolLM2's first batch
(49152 classes, 504 tokens), relative error of the gradient that reaches the last hidden state:
log-probabilities at 8 bits 0.021, probabilities at 4 bits 0.033, at 2 bits 0.10
(``benchmarks/log_probabilities.py``, docs/transformers.md).
So probabilities keep ``PROBABILITY_BITS`` (4), like softmax's (``daf.policy.exponent_guard``),
for half the bytes of the 8-bit log codes.

A coded probability may be 0, whose logarithm is ``-inf``: harmless to ``exp`` but not to an op that
reads the values themselves (``logp * p``). So only a save by an op whose backward reads the
log-probabilities through ``exp`` or not at all (``READERS``) is stored this way, and the record is
shared with those ops only (``daf.tracing.log_probabilities``); another op saving the same tensor gets
ordinary codes of its own.

Encoding goes through the tensor in slices of ``SLICE_ELEMENTS`` (whole groups), so that the
probabilities of a large vocabulary never exist in full beside the logits and the log-probabilities
(the end of an LM's forward is its peak); each slice draws its rounding noise from its own seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from daf.codec.backends import Backend
from daf.codec.spec import Spec
from daf.config import stochastic_at
from daf.format import Packed, flatten_memory_order, restore_memory_order
from daf.tracing.log_probabilities import READERS

__all__ = ["LogProbCodec", "LogProbPacked", "SLICE_ELEMENTS"]

SLICE_ELEMENTS = 1 << 20
# Probabilities below this are coded as 0: a group of them all would otherwise be a "tiny" group of
# the format, every element stored exactly; the error, under 2**-100, is far below the codes' own.
_NEGLIGIBLE = 2.0**-100
_GOLDEN = 0x9E3779B9


@dataclass
class LogProbPacked(Packed):
    """Format-1 codes of the float32 probabilities ``exp(y)`` in ``y``'s memory order (``dtype`` is
    float32); ``log_dtype`` is ``y``'s own, which decoding returns."""

    log_dtype: torch.dtype = torch.float32


class LogProbCodec:
    """Log-probabilities as codes of their probabilities, on ``backend``, groups of ``group_size``."""

    packed_type = LogProbPacked
    name = "logprobs"

    def __init__(self, backend: Backend, group_size: int = 256, rounding: str = "stochastic") -> None:
        self.backend = backend
        self.group_size = group_size
        self.rounding = rounding

    def readers(self, x: torch.Tensor, spec: Spec) -> frozenset[str]:
        """The ops that may share this record (see the module docstring)."""
        return READERS

    def encode(self, y: torch.Tensor, spec: Spec) -> LogProbPacked:
        flat, order = flatten_memory_order(y.detach())
        payload, exc_index, exc_value = self._encode_probabilities(flat, spec)
        return LogProbPacked(payload, tuple(y.shape), order, torch.float32, spec.bits, self.group_size,
                             exc_index, exc_value, log_dtype=y.dtype)

    def _encode_probabilities(self, flat: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                              torch.Tensor | None]:
        step = max(self.group_size, SLICE_ELEMENTS // self.group_size * self.group_size)
        payloads, indices, values = [], [], []
        for k, start in enumerate(range(0, flat.numel(), step)):
            probabilities = torch.exp(flat[start:start + step].float())
            probabilities.masked_fill_(probabilities < _NEGLIGIBLE, 0.0)
            seed = (spec.seed + k * _GOLDEN) & 0xFFFFFFFF
            payload, index, value = self.backend.encode_flat(probabilities, spec.bits, self.group_size,
                                                             stochastic_at(self.rounding, spec.bits), seed)
            payloads.append(payload)
            if index is not None:
                indices.append(index + start)
                values.append(value)
        payload = payloads[0] if len(payloads) == 1 else torch.cat(payloads)
        if not indices:
            return payload, None, None
        return payload, torch.cat(indices), torch.cat(values)

    def probabilities(self, packed: LogProbPacked) -> torch.Tensor:
        """The decoded probabilities, float32, flat in memory order, in [0, 1] (a step rounded up to
        bfloat16 may put the top code a little past the group's largest probability)."""
        flat = self.backend.decode_flat(packed.payload, packed.numel, packed.bits, packed.group_size,
                                        torch.float32, packed.exc_index, packed.exc_value)
        return flat.clamp_(0.0, 1.0)

    def decode(self, packed: LogProbPacked) -> torch.Tensor:
        flat = self.probabilities(packed).log_().to(packed.log_dtype)
        return restore_memory_order(flat, packed.shape, packed.order)

    def reencode(self, packed: LogProbPacked, bits: int, seed: int) -> LogProbPacked:
        """The same probabilities at fewer ``bits`` (demotion under a memory budget)."""
        flat = self.probabilities(packed).log_()
        payload, exc_index, exc_value = self._encode_probabilities(flat, Spec(bits, seed))
        return dataclasses.replace(packed, payload=payload, bits=bits, exc_index=exc_index, exc_value=exc_value)
