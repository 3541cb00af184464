"""Measuring a training run: process memory, activation bytes held, and their course over one step.

- ``PeakRSS``: the process's resident-set high-water mark (``VmHWM``), reset at the start of
  training through ``/proc/self/clear_refs`` so that loading data and weights does not count.
- ``SavedBytes``: saved-tensor hooks for the fp32 arm that keep every tensor as it is and count
  the bytes autograd holds for backward, the way ``daf.report`` counts them (parameters are
  referenced, not counted; a tensor saved twice counts once).
- ``StepTimeline``: samples (time, activation bytes held, RSS) after every leaf module's forward
  and whenever a gradient reaches a leaf module's output during backward.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from daf.tracing import TensorTable, is_parameter, parameter_storages

__all__ = ["PeakRSS", "SavedBytes", "StepTimeline", "rss_bytes", "peak_rss_bytes"]

_PAGE = 4096
_STATUS = Path("/proc/self/status")


def rss_bytes(pid: int | str = "self") -> int:
    """Current resident set size of a process (this one by default) in bytes; 0 where /proc is missing
    or the process is gone. O(1), about 10 us."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM``, what a RAM limit sees), or ``ru_maxrss``
    where /proc is missing."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """The peak resident set size since ``reset()``.

    ``resettable`` says whether the kernel let the high-water mark be reset; if not, ``peak()`` is
    the peak since the process started (``ru_maxrss``), which includes loading.
    """

    def __init__(self) -> None:
        self.resettable = False
        self.start = rss_bytes()

    def reset(self) -> None:
        self.start = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak(self) -> int:
        """Peak RSS in bytes since ``reset()`` (``peak_rss_bytes``)."""
        return peak_rss_bytes()


class _Held:
    """What autograd holds instead of a tensor under ``SavedBytes``: the tensor, counted until dropped."""

    __slots__ = ("tensor", "counter", "nbytes", "__weakref__")

    def __init__(self, tensor: torch.Tensor, counter: "SavedBytes", nbytes: int) -> None:
        self.tensor, self.counter, self.nbytes = tensor, counter, nbytes
        counter.live += nbytes

    def __del__(self) -> None:
        self.counter.live -= self.nbytes


class SavedBytes:
    """Saved-tensor hooks that change nothing and count bytes held for backward (fp32 arm).

    ``total`` is what one forward saved (like ``daf.report(model).raw_bytes``); ``live`` what is
    held right now. Use as ``with counter.hooks(model): loss = ...``.
    """

    def __init__(self) -> None:
        self.total = 0
        self.live = 0
        self._parameters: set[int] = set()
        self._seen = TensorTable()  # the session's own sharing rule: a tensor saved twice counts once

    def hooks(self, model: nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        self.total = 0
        self._seen.clear()
        self._parameters = parameter_storages(model)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if is_parameter(tensor, self._parameters):
            return tensor
        hit = self._seen.get(tensor)
        if hit is not None and hit() is not None:
            return hit()
        nbytes = tensor.numel() * tensor.element_size()
        held = _Held(tensor, self, nbytes)
        self.total += nbytes
        self._seen.put(tensor, weakref.ref(held))
        return held

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held


class StepTimeline:
    """Samples of one training step: ``events`` is a list of ``(seconds, phase, activation_bytes, rss_bytes)``.

    ``held`` is a callable returning the activation bytes held now (the fp32 counter's ``live`` or
    the DAF store's ``bytes_in_use``). Attach with ``attach(model)`` before the forward and
    ``detach()`` after the optimizer step; ``mark(phase)`` adds a sample by hand.
    """

    def __init__(self, held: Callable[[], int]) -> None:
        self.held = held
        self.events: list[tuple[float, str, int, int]] = []
        self._handles: list[Any] = []
        self._start = 0.0

    def attach(self, model: nn.Module) -> None:
        self.events = []
        self._start = time.perf_counter()
        self.mark("start")
        for module in model.modules():
            if next(module.children(), None) is None:
                self._handles.append(module.register_forward_hook(self._after_forward))

    def mark(self, phase: str) -> None:
        self.events.append((time.perf_counter() - self._start, phase, int(self.held()), rss_bytes()))

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.mark("forward")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            self._handles.append(output.register_hook(self._on_grad))

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.mark("backward")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def to_dict(self) -> dict[str, Any]:
        return {"columns": ["seconds", "phase", "activation_bytes", "rss_bytes"],
                "events": [list(e) for e in self.events]}
