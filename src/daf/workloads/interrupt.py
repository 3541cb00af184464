"""Ctrl-C during a training run: the first one stops the run at the end of the current step.

Python's default turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens
to be. Inside a ``__del__`` or a weakref callback it is only printed ("Exception ignored in ...")
and lost, so the run trained on (seen as a ``daf compare`` arm that ignored its Ctrl-C); inside a
saved-tensor hook it leaves a step half done. A flag set by the handler cannot be lost, and the
loop reads it between steps. A second Ctrl-C gets the previous handler back and interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

__all__ = ["StopRequest"]


class StopRequest:
    """``with StopRequest() as stop: ... if stop.requested: break``.

    Installs its handler only over Python's default one, on the main thread: a SIGINT that is
    ignored (a background job) or handled by the caller (a framework, a notebook) is left alone.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: signal.Handlers | None = None
        self._installed = False

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            current = signal.getsignal(signal.SIGINT)
            if current is signal.default_int_handler:
                self._previous = current
                signal.signal(signal.SIGINT, self._on_sigint)
                self._installed = True
        return self

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
