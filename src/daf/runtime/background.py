"""Background packing: compress saved tensors on a worker thread while forward goes on.

The session hands each tensor to ``BackgroundPacker.submit`` with its codec's name and
its ``Spec`` (the same one the session would encode with, so nothing is dropped on the
way) and keeps the future; the full-precision tensor is released as soon as the worker
has packed it. The session collects the results at the end of forward (or earlier, if
backward asks for one).

Off by default (``Config.background``): on the 2-core machine this was built on it does
not pay, see docs/kernels.md for the measurement.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from daf.codec import Codecs, Spec
from daf.format import Packed

__all__ = ["BackgroundPacker"]


class BackgroundPacker:
    """One worker thread running ``codecs.encode``; owned and closed by a session. Give it codecs
    that encode on their own thread only (``Codecs.serial_twin``)."""

    def __init__(self, codecs: Codecs) -> None:
        self.codecs = codecs
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="daf-pack")

    def submit(self, codec: str, tensor: torch.Tensor, spec: Spec) -> "Future[Packed]":
        """Encode ``tensor`` later; raises at ``result()`` if it was modified in place meanwhile."""
        return self._executor.submit(self._encode, codec, tensor, tensor._version, spec)

    def _encode(self, codec: str, tensor: torch.Tensor, version: int, spec: Spec) -> Packed:
        packed = self.codecs.encode(codec, tensor, spec)
        if tensor._version != version:  # autograd would refuse this tensor at backward too
            raise RuntimeError("a tensor saved for backward was modified in place while DAF packed it in the "
                               "background; fix the in-place operation or use Config(background=False)")
        return packed

    def close(self) -> None:
        """Finish queued work and stop the worker; idempotent.

        Called on the worker itself (a garbage collection there finalizing the session's model), it
        cannot wait for itself: the worker then stops after its current task.
        """
        on_worker = threading.current_thread() in getattr(self._executor, "_threads", ())
        self._executor.shutdown(wait=not on_worker)
