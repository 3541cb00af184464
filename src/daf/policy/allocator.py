"""Bit allocation: the bits of every site that minimize the estimated gradient variance under a budget.

The problem is a multiple-choice knapsack. Site ``i`` stores ``size_i`` elements and
offers a few choices ``b`` (bits per element: 1, 2, 4, 8, and 32 for "keep raw"),
each with an estimated cost ``cost_i(b)`` (the gradient variance it adds; for
stochastic rounding on a linear consumer ``C_i / (2**b - 1)**2``, 0 when raw)::

    minimize  sum_i cost_i(b_i)   subject to   sum_i size_i * b_i <= floor(average * sum_i elements_i)

``elements_i`` is how many elements of the activation the site stands for: its
``size`` unless only part of them needs codes (a ReLU output whose zeros its exact
mask already gives: ``size`` counts the nonzeros). So the bits stored per element
of the activations never exceed ``average``.

``allocate`` solves it by dynamic programming over the budget. Weights are
counted in units of ``u`` element-bits: ``u`` is the greatest common divisor of
every weight above the cheapest choice when that leaves at most ``max_cells``
DP cells (then the answer is exactly optimal), else the smallest unit that
does (weights rounded up, the budget rounded down: always within budget and
optimal for the rounded problem; the budget the rounding left over is then
spent greedily, best cost decrease per element-bit first). Cost: O(n * k * cells) time, O(n * cells) bytes,
with ``n`` sites, ``k`` choices each and ``cells <= max_cells``.

>>> plan = allocate([Site("a", 1000, variance_costs(9.0)), Site("b", 1000, variance_costs(1.0))], 2.0)
>>> plan.bits
{'a': 2, 'b': 2}
>>> plan = allocate([Site("a", 1000, variance_costs(100.0)), Site("b", 3000, variance_costs(1.0))], 2.0)
>>> plan.bits, plan.mean_bits
({'a': 4, 'b': 1}, 1.75)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce

import numpy as np

from daf.format import ALLOWED_BITS

__all__ = ["Site", "Plan", "allocate", "variance_costs", "RAW_BITS", "DEFAULT_CHOICES"]

RAW_BITS = 32  # what a site kept raw counts for in the budget (float32; the honest upper bound)
DEFAULT_CHOICES = ALLOWED_BITS
_MAX_CELLS = 1 << 22


def variance_costs(c: float, choices: tuple[int, ...] = DEFAULT_CHOICES, raw: bool = False) -> dict[int, float]:
    """The textbook cost table ``{b: c / (2**b - 1)**2}`` (plus ``{32: 0.0}`` with ``raw``). O(k).

    >>> variance_costs(9.0, (1, 2))
    {1: 9.0, 2: 1.0}
    """
    costs = {b: c / float((1 << b) - 1) ** 2 for b in choices}
    if raw:
        costs[RAW_BITS] = 0.0
    return costs


@dataclass(frozen=True)
class Site:
    """One allocation unit: ``size`` stored elements (int > 0), ``costs`` {bits: estimated variance >= 0},
    and the ``elements`` of the activation it counts for in the average (>= size; default: size)."""

    name: str
    size: int
    costs: dict[int, float]
    elements: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise ValueError(f"Site.size must be a positive integer, got {self.size!r} for site {self.name!r}")
        if self.elements == 0:
            object.__setattr__(self, "elements", self.size)
        if isinstance(self.elements, bool) or not isinstance(self.elements, int) or self.elements < self.size:
            raise ValueError(f"Site.elements must be an integer >= size ({self.size}), got {self.elements!r} "
                             f"for site {self.name!r}")
        if not self.costs:
            raise ValueError(f"Site.costs must offer at least one choice, got none for site {self.name!r}")
        for bits, cost in self.costs.items():
            if isinstance(bits, bool) or not isinstance(bits, int) or bits <= 0:
                raise ValueError(f"Site.costs keys must be positive bit counts, got {bits!r} for site {self.name!r}")
            if not (cost >= 0 and math.isfinite(cost)):
                raise ValueError(f"Site.costs values must be finite and >= 0, got {cost!r} at {bits} bits "
                                 f"for site {self.name!r}")


@dataclass
class Plan:
    """The chosen bits per site, what they cost and how much of the budget they use
    (``mean_bits``: stored code bits per element of the activations)."""

    bits: dict[str, int]
    cost: float
    mean_bits: float
    average: float
    exact: bool
    unit: int = 1
    sizes: dict[str, int] = field(default_factory=dict, repr=False)


def _check_average(average: float) -> None:
    if isinstance(average, bool) or not isinstance(average, (int, float)) or not math.isfinite(average) \
            or average <= 0:
        raise ValueError(f"average must be a positive number of bits per element, got {average!r}")


def _capacity(average: float, total: int) -> int:
    """The most element-bits ``c`` with ``c / total <= average`` in float arithmetic (what callers check)."""
    capacity = math.floor(average * total)
    while (capacity + 1) / total <= average:
        capacity += 1
    while capacity > 0 and capacity / total > average:
        capacity -= 1
    return capacity


def allocate(sites: list[Site], average: float, max_cells: int = _MAX_CELLS) -> Plan:
    """The choice per site of least total cost with ``sum(size * bits) <= floor(average * sum(elements))``.

    Raises ``ValueError`` when even the cheapest choice of every site passes the budget.
    Time O(n * k * cells), memory O(n * cells), cells <= ``max_cells`` (see the module docstring).
    """
    _check_average(average)
    if not sites:
        return Plan({}, 0.0, 0.0, float(average), True)
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        raise ValueError("allocate needs distinct site names")
    total = sum(s.elements for s in sites)
    capacity = _capacity(average, total)
    low = [min(s.costs) for s in sites]
    spare = capacity - sum(s.size * b for s, b in zip(sites, low))
    if spare < 0:
        cheapest = min(min(s.costs) for s in sites)
        raise ValueError(f"average {average} bits is below what the cheapest choices need "
                         f"({sum(s.size * b for s, b in zip(sites, low)) / total:.4g} bits on average; "
                         f"the fewest bits offered is {cheapest})")
    options = [sorted(s.costs) for s in sites]
    extra = [[s.size * (b - lo) for b in opts] for s, opts, lo in zip(sites, options, low)]
    g = reduce(math.gcd, (w for ws in extra for w in ws if w), 0)
    if g == 0:  # a single choice everywhere
        chosen = [opts[0] for opts in options]
        return _plan(sites, chosen, average, True, 1)
    unit = g
    exact = True
    if spare // unit + 1 > max_cells // max(1, len(sites)):
        cells = max(2, max_cells // max(1, len(sites)))
        unit = max(g, -(-spare // (cells - 1)))
        exact = unit == g
    width = spare // unit + 1
    best = np.zeros(width, dtype=np.float64)  # best[c]: least cost of the sites so far within c units
    choice = np.zeros((len(sites), width), dtype=np.int8)
    for i, (s, opts, ws) in enumerate(zip(sites, options, extra)):
        new = np.full(width, np.inf)
        pick = np.zeros(width, dtype=np.int8)
        for k, (b, w) in enumerate(zip(opts, ws)):
            units = -(-w // unit)
            if units >= width:
                continue
            candidate = np.full(width, np.inf)
            candidate[units:] = best[: width - units] + s.costs[b]
            better = candidate < new
            new[better] = candidate[better]
            pick[better] = k
        best, choice[i] = new, pick
    c = width - 1
    chosen = [0] * len(sites)
    for i in range(len(sites) - 1, -1, -1):
        k = int(choice[i, c])
        chosen[i] = options[i][k]
        c -= -(-extra[i][k] // unit)
    if not exact:
        _fill(sites, chosen, capacity)
    return _plan(sites, chosen, average, exact, unit)


def _fill(sites: list[Site], chosen: list[int], capacity: int) -> None:
    """Spend the budget that rounding to coarse units left over: repeatedly take the upgrade with
    the largest cost decrease per element-bit that still fits. O(upgrades * n * k)."""
    left = capacity - sum(s.size * b for s, b in zip(sites, chosen))
    while True:
        best = None
        for i, s in enumerate(sites):
            now = chosen[i]
            for b, cost in s.costs.items():
                extra = s.size * (b - now)
                gain = s.costs[now] - cost
                if b > now and extra <= left and gain > 0 and (best is None or gain / extra > best[0]):
                    best = (gain / extra, i, b, extra)
        if best is None:
            return
        _, i, b, extra = best
        chosen[i], left = b, left - extra


def _plan(sites: list[Site], chosen: list[int], average: float, exact: bool, unit: int) -> Plan:
    total = sum(s.elements for s in sites)
    used = sum(s.size * b for s, b in zip(sites, chosen))
    cost = sum(s.costs[b] for s, b in zip(sites, chosen))
    return Plan({s.name: b for s, b in zip(sites, chosen)}, cost, used / total, float(average), exact, unit,
                {s.name: s.size for s in sites})
