"""The native backend: ``encode_flat``/``decode_flat`` of the reference on the ``torch.ops.daf`` ops.

What it adds to the ops is the choice of the encode kernel's reduction strategy (timed by a
per-session ``Autotuner``) and the ``serial`` flag of a background packer. Which
implementation runs (C++ kernels, or the reference for what they do not take) is decided by
the op registration (``daf.kernels.ops``), not here.
"""

from __future__ import annotations

import torch

from daf.format import num_groups
from daf.kernels import ops
from daf.kernels.autotune import Autotuner
from daf.kernels.ops import STRATEGIES

__all__ = ["NativeBackend", "STRATEGIES"]

# Below this size both strategies run on one thread (kGrainElements * 2 in kernels.h): nothing to tune.
_TUNE_MIN_NUMEL = 32768
# With at least this many groups per thread, splitting groups across threads cannot pay.
_MANY_GROUPS_PER_THREAD = 16


class NativeBackend:
    """Format-1 encode/decode through ``torch.ops.daf``, with its own strategy autotuner.

    ``serial=True`` encodes on the calling thread only (for a background packer, so that it
    does not start a second team of threads beside torch's). ``fallbacks`` counts tensors
    that held exceptional values (encoded by the reference, with a side table); ``reason``
    says why this backend was chosen (``daf.codec.backends.select_backend``).
    """

    name = "native"

    def __init__(self, tuner: Autotuner | None = None, serial: bool = False, reason: str = "asked for by name") -> None:
        self.tuner = tuner if tuner is not None else Autotuner()
        self.serial = serial
        self.reason = reason
        self.fallbacks = 0

    def serial_twin(self) -> NativeBackend:
        """A backend on the same autotuner that encodes on the calling thread only."""
        return NativeBackend(self.tuner, serial=True, reason=self.reason)

    def encode_flat(
        self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int,
        strategy: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Quantize and pack a flat tensor into format-1 rows (see ``reference.encode_flat``).

        x: float32|float16|bfloat16|float64 [numel] -> (payload uint8 [num_groups * row_bytes],
        exc_index, exc_value), the reference's bytes. ``strategy`` (a key of ``STRATEGIES``)
        overrides the autotuner. O(numel), one pass over x on the kernels.
        """
        ops.check_format(bits, group_size)
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)} or None, got {strategy!r}")
        x = x.reshape(-1)
        if strategy is None:
            strategy = self._strategy(x, bits, group_size, stochastic, seed)
        result = ops.encode_flat(x, bits, group_size, stochastic, seed, strategy, self.serial)
        if result[1] is not None:
            self.fallbacks += 1
        return result

    def decode_flat(self, payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Unpack and dequantize format-1 rows straight into a tensor (see ``reference.decode_flat``).

        payload uint8 [num_groups * row_bytes] -> dtype [numel]. O(numel), one pass. ``out``
        (contiguous, CPU, ``dtype``, ``numel`` elements) receives the values instead of a new
        tensor: a fresh multi-MiB tensor costs page faults that can exceed the decoding itself.
        """
        if out is None:
            return ops.decode_flat(payload, numel, bits, group_size, dtype, exc_index, exc_value)
        if not (out.dtype == dtype and out.numel() == numel and out.is_contiguous() and out.device.type == "cpu"):
            raise ValueError(f"out must be a contiguous CPU {dtype} tensor of {numel} elements, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})")
        return ops.decode_into(payload, bits, group_size, out, exc_index, exc_value)

    def decode_into(self, payload: torch.Tensor, bits: int, group_size: int, out: torch.Tensor,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None) -> torch.Tensor:
        """The values into ``out`` in its logical order, whatever its layout: a channels-last ``out``
        is filled in one pass (``daf::format1_decode_into``)."""
        return ops.decode_into(payload, bits, group_size, out, exc_index, exc_value)

    def _strategy(self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int) -> str:
        """Whole groups where it is bound to win; the autotuner's timed choice where it is not."""
        if x.numel() < _TUNE_MIN_NUMEL or self.serial:  # one thread: the strategies coincide
            return "whole_groups"
        if not ops.native_takes(x.dtype, x.is_cpu, group_size):  # the reference has no strategies
            return "whole_groups"
        if num_groups(x.numel(), group_size) >= _MANY_GROUPS_PER_THREAD * torch.get_num_threads():
            # Enough groups to balance the threads: one pass beats two, timing could only add noise.
            return "whole_groups"
        shape_class = (f"{str(x.dtype).replace('torch.', '')}|b{bits}|{'sr' if stochastic else 'rn'}"
                       f"|g{group_size}|n2^{x.numel().bit_length() - 1}")

        def run(name: str) -> object:
            return torch.ops.daf.format1_encode(x, bits, group_size, stochastic, seed & 0xFFFFFFFF,
                                                STRATEGIES[name], self.serial)

        return self.tuner.choose(shape_class, tuple(STRATEGIES), run)
