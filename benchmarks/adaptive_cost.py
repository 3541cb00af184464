"""Step time of the adaptive policy against uniform bits at the same average (issue 15, item 4).

python benchmarks/adaptive_cost.py [--workloads resnet18-fmnist,minilm-tweets] [--batch 32] [--resnet-batch 128]
    [--steps 20] [--warmup 3] [--replan-every 10] [--average 2.0] [--arms uniform,adaptive[,adaptive-dense]] [--json FILE]

For each workload two models with the same weights train on the same batches, one under
``daf.wrap(bits=2)`` and one under ``daf.wrap(policy=daf.Adaptive(average=2.0, replan_every=R))``;
their steps alternate (which goes first alternates too), so a change in machine load hits both
alike; the median of the per-round ratios is the figure to trust on a loaded machine. ``adaptive-dense`` is the adaptive policy with codes for every element of a ReLU output (no
compaction to its nonzeros, docs/policy.md section 3a): it separates the policy's own bookkeeping
from the compaction and scatter in ``daf.codec.nonzeros``. Reported: the median step (the steady state between plans) and the mean over whole re-plan
cycles (what a long run pays, the watched forwards and the re-plans included), and their ratios.
Hold the shared lock: ``flock /tmp/daf-cpu.lock python benchmarks/adaptive_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from typing import Any

import torch

import daf
from daf.policy import AdaptivePolicy, Policy, register_policy
from daf.bench.overhead import timed_step
from daf.workloads import get_workload

_OPTIONS = {"resnet18-fmnist": {"width": 64}, "minilm-tweets": {}}


@dataclass(frozen=True)
class DenseAdaptive:
    """The adaptive policy storing codes for every element of a ReLU output (no nonzeros compaction)."""

    average: float = 2.0
    replan_every: int = 10


@register_policy(DenseAdaptive)
def _dense_adaptive(config: daf.Config) -> Policy:
    policy = AdaptivePolicy(config.policy.average, config.group_size, config.policy.replan_every)
    policy.codes_nonzeros_only = False
    return policy


def _configs(average: float, replan_every: int) -> dict[str, daf.Config]:
    return {"uniform": daf.Config(bits=round(average)),
            "adaptive": daf.Config(policy=daf.Adaptive(average=average, replan_every=replan_every)),
            "adaptive-dense": daf.Config(policy=DenseAdaptive(average, replan_every))}


def _arm(workload: Any, config: daf.Config, steps: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = daf.wrap(workload.build_model(), config)
    return model, workload.optimizer(model, steps)[0]


def run(name: str, batch: int, steps: int = 20, warmup: int = 3, replan_every: int = 10, average: float = 2.0,
        arms: tuple[str, ...] = ("uniform", "adaptive")) -> dict[str, Any]:
    """Seconds per step of uniform ``round(average)`` bits and of ``Adaptive(average)`` (and the other
    ``arms``), interleaved; ratios against uniform."""
    workload = get_workload(name, **_OPTIONS.get(name, {}))
    configs = _configs(average, replan_every)
    models = {arm: _arm(workload, configs[arm], warmup + steps) for arm in arms}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for index, data in enumerate(workload.batches(batch, warmup + steps)):
        shift = index % len(arms)  # which arm goes first rotates
        order = list(arms[shift:] + arms[:shift])
        for arm in order:
            seconds = timed_step(workload, *models[arm], data)
            if index >= warmup:
                times[arm].append(seconds)
    # whole cycles of the measured steps, for the mean (a cycle: replan_every forwards, one re-plan)
    cycles = max(1, steps // replan_every) * replan_every if steps >= replan_every else steps
    out: dict[str, Any] = {"workload": name, "batch": batch, "steps": steps, "warmup": warmup,
                           "replan_every": replan_every, "average": average, "times": times}
    out["arms"] = {}
    for arm, values in times.items():
        out["arms"][arm] = {"median_s": statistics.median(values), "mean_s": statistics.fmean(values[:cycles])}
    base = out["arms"]["uniform"]
    for arm, figures in out["arms"].items():
        figures["median_ratio"] = figures["median_s"] / base["median_s"]
        figures["mean_ratio"] = figures["mean_s"] / base["mean_s"]
        # each round runs every arm back to back, under about the same load: on a shared machine whose
        # load swings the step time 5x, the median of these per-round ratios is the figure to trust
        figures["round_ratio"] = statistics.median(a / u for a, u in zip(times[arm], times["uniform"]))
    return out


def table(results: list[dict[str, Any]]) -> str:
    """One row per workload and arm: median and mean seconds per step, and their ratios to uniform."""
    lines = [f"{'workload':16s} {'batch':>5s} {'arm':15s} {'median s':>9s} {'x uniform':>9s} {'mean s':>8s} "
             f"{'x uniform':>9s} {'per-round x uniform':>19s}"]
    for r in results:
        for arm, f in r["arms"].items():
            lines.append(f"{r['workload']:16s} {r['batch']:5d} {arm:15s} {f['median_s']:9.3f} "
                         f"{f['median_ratio']:9.3f} {f['mean_s']:8.3f} {f['mean_ratio']:9.3f} {f['round_ratio']:19.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="resnet18-fmnist,minilm-tweets")
    parser.add_argument("--batch", type=int, default=32, help="batch of every workload (default 32)")
    parser.add_argument("--resnet-batch", type=int, default=None, help="batch of resnet18-fmnist (e.g. 128)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--replan-every", type=int, default=10)
    parser.add_argument("--average", type=float, default=2.0)
    parser.add_argument("--arms", default="uniform,adaptive", help="of uniform, adaptive, adaptive-dense")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for name in args.workloads.split(","):
        batch = args.resnet_batch if name == "resnet18-fmnist" and args.resnet_batch else args.batch
        arms = tuple(args.arms.split(","))
        if arms[0] != "uniform":
            raise SystemExit("--arms must start with uniform (the baseline of the ratios)")
        results.append(run(name, batch, args.steps, args.warmup, args.replan_every, args.average, arms))
        print(table(results[-1:]), flush=True)
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
