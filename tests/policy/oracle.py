"""The test oracle of ``daf.policy.allocate``: the optimum by trying every combination."""

from __future__ import annotations

import itertools

from daf.policy import Plan, Site


def brute_force(sites: list[Site], average: float) -> Plan:
    """The cheapest bits per site whose stored element-bits per element of the activations are at most
    ``average`` (checked as ``allocate``'s callers check it: ``used / total <= average``).

    O(k**n) time: for a handful of sites only. Ties go to the first combination in lexicographic
    order of the sorted choices. ``ValueError`` when not even the cheapest choices fit.
    """
    total = sum(s.elements for s in sites)
    best: tuple[float, tuple[int, ...]] | None = None
    for combo in itertools.product(*[sorted(s.costs) for s in sites]):
        if sum(s.size * b for s, b in zip(sites, combo)) / total > average:
            continue
        cost = sum(s.costs[b] for s, b in zip(sites, combo))
        if best is None or cost < best[0]:
            best = (cost, combo)
    if best is None:
        raise ValueError(f"average {average} bits is below what the cheapest choices need")
    used = sum(s.size * b for s, b in zip(sites, best[1]))
    return Plan({s.name: b for s, b in zip(sites, best[1])}, best[0], used / total, float(average), True, 1,
                {s.name: s.size for s in sites})
