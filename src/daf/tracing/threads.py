"""State kept per thread: a forward on another thread has its own."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["PerThreadStack"]


class PerThreadStack(threading.local):
    """``items``: a list of this thread's own, made empty on the thread's first use."""

    def __init__(self) -> None:
        self.items: list[Any] = []
