"""What the memory layer raises when it cannot keep its promise."""

from __future__ import annotations

__all__ = ["OutOfBudget", "SpillError", "StoreClosed"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB ({n} B)"


class OutOfBudget(MemoryError):
    """An activation cannot be stored within ``Config.budget``, even after demotion and spilling.

    ``asked``, ``budget`` and ``in_use`` are byte counts; the message states all three.
    """

    def __init__(self, site: str, asked: int, budget: int, in_use: int, why: str) -> None:
        self.site, self.asked, self.budget, self.in_use = site, asked, budget, in_use
        super().__init__(
            f"activation {site!r} needs {_mib(asked)} but Config.budget is {_mib(budget)} and {_mib(in_use)} "
            f"are in use: {why}; raise Config.budget, lower Config.min_bits, or use a smaller batch"
        )


class SpillError(RuntimeError):
    """Spilled activation data could not be written, could not be read back or came back different from
    what was written. The message names the activation's site and the file."""


class StoreClosed(RuntimeError):
    """An activation was to be stored after the store was closed (its session closed, its model unwrapped)."""

    def __init__(self, site: str) -> None:
        self.site = site
        super().__init__(
            f"DAF's activation store is closed (its model was unwrapped or its session closed), so activation "
            f"{site!r} cannot be stored; records stored before stay readable until released. Run forward "
            f"through a wrapped model, or wrap it again")
