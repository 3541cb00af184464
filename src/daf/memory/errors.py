"""What the memory layer raises when it cannot keep its promise."""

from __future__ import annotations

__all__ = ["OutOfBudget", "SpillError"]


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
    """Spilled activation data could not be written or came back different from what was written."""
