"""``daf compare --seeds N``: the same comparison at N seeds, summarized as mean and spread; ``daf seeds
FILE...``: the same summary over runs made at different times (each seed in its own run or session).

One seed is one sample of the initial weights and the data order; a difference of a few tenths of a
point between fp32 and DAF is within what the seed alone moves (docs/results.md), so accuracy figures
are given over several seeds.
"""

from __future__ import annotations

import statistics
from typing import Any

from daf.cli.table import headline

__all__ = ["seed_summary", "format_seed_summary", "combine_records"]


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


# -- ``daf seeds FILE...``: one summary over runs made at different times ----------------------------

_SAME_FOR_ALL = ("workload", "steps_requested", "batch")
# where tensors come from (and whether freed memory is kept), which kernels run (and the layout they get) and the rounding seed: not what is compared
_NOT_THE_METHOD = ("allocator", "decommit", "backend", "channels_last", "seed")


def _method(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a DAF config compresses with (None for fp32), without the settings that do not change it."""
    if config is None:
        return None
    from daf.config import Config
    return {k: v for k, v in Config.from_dict(config).to_dict().items() if k not in _NOT_THE_METHOD}


def combine_records(records: list[tuple[str, dict[str, Any]]]) -> tuple[dict[int, dict[str, dict[str, Any]]], list[str]]:
    """Runs of ``daf train`` / ``daf compare`` JSON files (``(file, data)``), by seed and arm, and notes on the
    runs left out (interrupted or not evaluated). ValueError, naming the files, when they cannot be one
    comparison: other workloads, steps, batches, workload options or DAF settings, two runs of one arm at
    one seed, or an fp32 and a DAF run of one seed that did not start from the same weights and batches."""
    from daf.cli.table import config_label
    runs: list[tuple[str, dict[str, Any]]] = []
    notes: list[str] = []
    for name, data in records:
        if data.get("schema") != "daf.results/1":
            raise ValueError(f"{name}: not a daf results file (schema {data.get('schema')!r}, expected 'daf.results/1')")
        for run in data["runs"].values():
            if run.get("interrupted") or run.get("steps_done") != run.get("steps_requested") or headline(run) is None:
                notes.append(f"{name}: the {run['arm']} run of seed {run['seed']} is left out (interrupted or "
                             f"not evaluated: {run.get('steps_done')}/{run.get('steps_requested')} steps)")
            else:
                runs.append((name, run))
    if not runs:
        raise ValueError("no finished run in " + ", ".join(name for name, _ in records))
    first_name, first = runs[0]
    methods: dict[str, tuple[str, Any, Any]] = {}  # arm -> (file, method, config) of its first run
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    where: dict[tuple[int, str], str] = {}
    for name, run in runs:
        for key in (*_SAME_FOR_ALL, "options"):
            mine, theirs = _without_seed(run, key), _without_seed(first, key)
            if mine != theirs:
                raise ValueError(f"{name} and {first_name} differ in {key} ({mine!r} against {theirs!r}): "
                                 f"not one comparison")
        arm = "fp32" if run["config"] is None else "daf"
        method = _method(run["config"])
        if arm in methods and methods[arm][1] != method:
            raise ValueError(f"{name} and {methods[arm][0]} trained DAF differently ({config_label(run['config'])} "
                             f"against {config_label(methods[arm][2])}): not one comparison")
        methods.setdefault(arm, (name, method, run["config"]))
        seed = int(run["seed"])
        if (seed, arm) in where:
            raise ValueError(f"two {arm} runs of seed {seed}: {where[seed, arm]} and {name}; give one of them")
        where[seed, arm] = name
        by_seed.setdefault(seed, {})[arm] = run
    for seed, pair in by_seed.items():
        if len(pair) == 2 and any(pair["fp32"][d] != pair["daf"][d] for d in ("init_digest", "data_digest")):
            raise ValueError(f"seed {seed}: the fp32 run ({where[seed, 'fp32']}) and the DAF run "
                             f"({where[seed, 'daf']}) did not start from the same weights and batches "
                             f"(init_digest/data_digest differ)")
    return dict(sorted(by_seed.items())), notes


def _without_seed(run: dict[str, Any], key: str) -> Any:
    value = run.get(key)
    return {k: v for k, v in value.items() if k != "seed"} if key == "options" and isinstance(value, dict) else value
