"""The native backend: the reference's ``encode_flat``/``decode_flat`` on the C++ kernels.

Byte-identical to ``daf.codec.reference`` (tests/kernels check it). What the kernels do
not cover is handed to the reference, whole tensor at a time:

- tensors with exceptional values (NaN, ±Inf, ``|x| > 2**126``): the kernel's range pass
  flags them and the tensor is encoded again by the reference, which builds the side table;
- float64 tensors, tensors on other devices, group sizes that are not powers of two >= 8.
"""

from __future__ import annotations

from types import ModuleType

import torch

from daf.codec import reference
from daf.format import num_groups, payload_bytes
from daf.kernels.autotune import Autotuner

__all__ = ["NativeBackend", "STRATEGIES"]

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Reduction strategies of the encode kernel (csrc/kernels.h): threads own whole groups,
# or threads split the element range and merge partial min/max per group.
STRATEGIES = {"whole_groups": 0, "split_range": 1}
# Below this size both strategies run on one thread (kGrainElements * 2 in kernels.h): nothing to tune.
_TUNE_MIN_NUMEL = 32768
# With at least this many groups per thread, splitting groups across threads cannot pay.
_MANY_GROUPS_PER_THREAD = 16
_MASK32 = 0xFFFFFFFF


class NativeBackend:
    """Format-1 encode/decode through the native kernels, with its own strategy autotuner.

    ``serial=True`` encodes on the calling thread only (for a background packer, so that it
    does not start a second team of threads beside torch's). ``fallbacks`` counts tensors
    handed to the reference because of exceptional values.
    """

    name = "native"

    def __init__(self, extension: ModuleType, tuner: Autotuner | None = None, serial: bool = False) -> None:
        self._ext = extension
        self.tuner = tuner if tuner is not None else Autotuner()
        self.serial = serial
        self.fallbacks = 0

    def serial_twin(self) -> "NativeBackend":
        """A backend on the same library and autotuner that encodes on the calling thread only."""
        return NativeBackend(self._ext, self.tuner, serial=True)

    def supports(self, x: torch.Tensor, group_size: int) -> bool:
        """Whether the kernels take this input (else the reference does)."""
        return (x.dtype in _DTYPE_CODES and x.device.type == "cpu" and group_size >= 8
                and group_size & (group_size - 1) == 0)

    def encode_flat(
        self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int,
        strategy: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Quantize and pack a flat tensor into format-1 rows (see ``reference.encode_flat``).

        x: float32|float16|bfloat16 [numel] -> (payload uint8 [num_groups * row_bytes], None, None),
        or the reference's result for inputs listed in the module docstring. ``strategy``
        (a key of ``STRATEGIES``) overrides the autotuner. O(numel), one pass over x.
        """
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"bits must be one of (1, 2, 4, 8), got {bits}")
        if not self.supports(x, group_size):
            return reference.encode_flat(x, bits, group_size, stochastic, seed)
        x = x.reshape(-1).contiguous()
        numel = x.numel()
        payload = torch.empty(payload_bytes(numel, bits, group_size), dtype=torch.uint8)
        if numel == 0:
            return payload, None, None

        def run(name: str) -> bool:
            return self._ext.encode(x.data_ptr(), numel, _DTYPE_CODES[x.dtype], payload.data_ptr(), bits,
                                    group_size, stochastic, seed & _MASK32, STRATEGIES[name], self.serial)

        if strategy is None:
            strategy = self._strategy(x, bits, group_size, stochastic, run)
        elif strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {sorted(STRATEGIES)} or None, got {strategy!r}")
        if not run(strategy):
            self.fallbacks += 1
            return reference.encode_flat(x, bits, group_size, stochastic, seed)
        return payload, None, None

    def decode_flat(self, payload: torch.Tensor, numel: int, bits: int, group_size: int, dtype: torch.dtype,
                    exc_index: torch.Tensor | None = None, exc_value: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Unpack and dequantize format-1 rows straight into a tensor (see ``reference.decode_flat``).

        payload uint8 [num_groups * row_bytes] -> dtype [numel]. O(numel), one pass. ``out``
        (contiguous, CPU, ``dtype``, ``numel`` elements) receives the values instead of a new
        tensor: a fresh multi-MiB tensor costs page faults that can exceed the decoding itself.
        """
        if bits not in (1, 2, 4, 8):
            raise ValueError(f"bits must be one of (1, 2, 4, 8), got {bits}")
        if (dtype not in _DTYPE_CODES or payload.device.type != "cpu" or payload.dtype != torch.uint8
                or group_size < 8 or group_size & (group_size - 1)):
            values = reference.decode_flat(payload, numel, bits, group_size, dtype, exc_index, exc_value)
            return values if out is None else out.view(-1).copy_(values).view_as(out)
        expected = payload_bytes(numel, bits, group_size)
        if payload.numel() != expected:
            raise ValueError(f"payload has {payload.numel()} bytes; {numel} elements at {bits} bits, "
                             f"group_size {group_size} need {expected}")
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        elif not (out.dtype == dtype and out.numel() == numel and out.is_contiguous() and out.device.type == "cpu"):
            raise ValueError(f"out must be a contiguous CPU {dtype} tensor of {numel} elements, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})")
        payload = payload.contiguous()
        if numel:
            self._ext.decode_into(payload.data_ptr(), numel, bits, group_size, _DTYPE_CODES[dtype], out.data_ptr())
        if exc_index is not None and exc_index.numel():
            out.view(-1)[exc_index] = exc_value.to(dtype)
        return out

    def _strategy(self, x: torch.Tensor, bits: int, group_size: int, stochastic: bool, run) -> str:
        """Whole groups where it is bound to win; the autotuner's timed choice where it is not."""
        if x.numel() < _TUNE_MIN_NUMEL or self.serial:  # one thread: the strategies coincide
            return "whole_groups"
        if num_groups(x.numel(), group_size) >= _MANY_GROUPS_PER_THREAD * torch.get_num_threads():
            # Enough groups to balance the threads: one pass beats two, timing could only add noise.
            return "whole_groups"
        shape_class = (f"{str(x.dtype).replace('torch.', '')}|b{bits}|{'sr' if stochastic else 'rn'}"
                       f"|g{group_size}|n2^{x.numel().bit_length() - 1}")
        return self.tuner.choose(shape_class, tuple(STRATEGIES), run)
