"""``daf compare --seeds N``: the same comparison at N seeds, summarized as mean and spread.

One seed is one sample of the initial weights and the data order; a difference of a few tenths of a
point between fp32 and DAF is within what the seed alone moves (docs/results.md), so accuracy figures
are given over several seeds.
"""

from __future__ import annotations

import statistics
from typing import Any

from daf.cli.table import headline

__all__ = ["seed_summary", "format_seed_summary"]


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def seed_summary(runs_by_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per arm, the headline metric at each seed and its mean, sample standard deviation, min and max;
    the same for DAF minus fp32 (points for accuracy, relative % for a loss) over the seeds where both ran.
    Only seeds whose runs were evaluated count."""
    metric = next((run["metric"] for runs in runs_by_seed.values() for run in runs.values()), None)
    scale = 100.0 if metric == "accuracy" else 1.0
    summary: dict[str, Any] = {"metric": metric, "seeds": sorted(runs_by_seed), "arms": {}}
    for arm in ("fp32", "daf"):
        values = {seed: headline(runs[arm]) for seed, runs in runs_by_seed.items() if arm in runs}
        values = {seed: scale * v for seed, v in values.items() if v is not None}
        if values:
            summary["arms"][arm] = {"values": values, **_spread(list(values.values()))}
    both = [seed for seed in runs_by_seed
            if all(seed in summary["arms"].get(arm, {}).get("values", {}) for arm in ("fp32", "daf"))]
    if both:
        fp32, daf = summary["arms"]["fp32"]["values"], summary["arms"]["daf"]["values"]
        differences = [daf[s] - fp32[s] if metric == "accuracy" else 100 * (daf[s] - fp32[s]) / fp32[s] for s in both]
        summary["difference"] = {"unit": "points" if metric == "accuracy" else "% relative",
                                 "values": dict(zip(both, differences)), **_spread(differences)}
    return summary


def format_seed_summary(summary: dict[str, Any]) -> str:
    """Lines: each arm's metric as mean ± std (min..max) over its seeds, then DAF minus fp32.

    >>> s = {"metric": "accuracy", "seeds": [0, 1], "arms": {"fp32": {"values": {0: 90.0, 1: 91.0}, "mean": 90.5,
    ...      "std": 0.71, "min": 90.0, "max": 91.0}}}
    >>> print(format_seed_summary(s))
    over seeds 0, 1 (eval accuracy, %):
      fp32  90.50 ± 0.71 (90.00 .. 91.00), 2 seeds
    """
    unit = "eval accuracy, %" if summary["metric"] == "accuracy" else "eval loss"
    lines = [f"over seeds {', '.join(str(s) for s in summary['seeds'])} ({unit}):"]
    digits = 2 if summary["metric"] == "accuracy" else 4
    for arm, figures in summary["arms"].items():
        lines.append(f"  {arm:4}  {figures['mean']:.{digits}f} ± {figures['std']:.{digits}f} "
                     f"({figures['min']:.{digits}f} .. {figures['max']:.{digits}f}), {len(figures['values'])} seeds")
    difference = summary.get("difference")
    if difference:
        lines.append(f"  DAF - fp32: {difference['mean']:+.2f} ± {difference['std']:.2f} {difference['unit']} "
                     f"({difference['min']:+.2f} .. {difference['max']:+.2f})")
    return "\n".join(lines)
