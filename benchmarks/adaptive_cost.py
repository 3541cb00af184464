"""Step time of the adaptive policy against uniform bits at the same average (issue 15, item 4).

python benchmarks/adaptive_cost.py [--workloads resnet18-fmnist,minilm-tweets] [--batch 32] [--resnet-batch 128]
    [--steps 20] [--warmup 3] [--replan-every 10] [--average 2.0] [--json FILE]

For each workload two models with the same weights train on the same batches, one under
``daf.wrap(bits=2)`` and one under ``daf.wrap(policy=daf.Adaptive(average=2.0, replan_every=R))``;
their steps alternate (which goes first alternates too), so a change in machine load hits both
alike. Reported: the median step (the steady state between plans) and the mean over whole re-plan
cycles (what a long run pays, the watched forwards and the re-plans included), and their ratios.
Hold the shared lock: ``flock /tmp/daf-cpu.lock python benchmarks/adaptive_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import daf
from daf.workloads import get_workload

_OPTIONS = {"resnet18-fmnist": {"width": 64}, "minilm-tweets": {}}


def _arm(workload: Any, config: daf.Config, steps: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = daf.wrap(workload.build_model(), config)
    return model, workload.optimizer(model, steps)[0]


def _step(workload: Any, model: Any, optimizer: Any, batch: Any) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model, batch).backward()
    optimizer.step()
    return time.perf_counter() - start


def run(name: str, batch: int, steps: int = 20, warmup: int = 3, replan_every: int = 10,
        average: float = 2.0) -> dict[str, Any]:
    """Seconds per step of uniform ``round(average)`` bits and of ``Adaptive(average)``, interleaved."""
    workload = get_workload(name, **_OPTIONS.get(name, {}))
    configs = {"uniform": daf.Config(bits=round(average)),
               "adaptive": daf.Config(policy=daf.Adaptive(average=average, replan_every=replan_every))}
    arms = {arm: _arm(workload, config, warmup + steps) for arm, config in configs.items()}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for index, data in enumerate(workload.batches(batch, warmup + steps)):
        order = list(arms) if index % 2 == 0 else list(reversed(arms))
        for arm in order:
            seconds = _step(workload, *arms[arm], data)
            if index >= warmup:
                times[arm].append(seconds)
    # whole cycles of the measured steps, for the mean (a cycle: replan_every forwards, one re-plan)
    cycles = max(1, steps // replan_every) * replan_every if steps >= replan_every else steps
    out: dict[str, Any] = {"workload": name, "batch": batch, "steps": steps, "warmup": warmup,
                           "replan_every": replan_every, "average": average, "times": times}
    for arm, values in times.items():
        out[f"{arm}_median_s"] = statistics.median(values)
        out[f"{arm}_mean_s"] = statistics.fmean(values[:cycles])
    out["median_ratio"] = out["adaptive_median_s"] / out["uniform_median_s"]
    out["mean_ratio"] = out["adaptive_mean_s"] / out["uniform_mean_s"]
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'workload':16s} {'batch':>5s} {'uniform med s':>13s} {'adaptive med s':>14s} {'ratio':>6s} "
             f"{'uniform mean s':>14s} {'adaptive mean s':>15s} {'ratio':>6s}"]
    for r in results:
        lines.append(f"{r['workload']:16s} {r['batch']:5d} {r['uniform_median_s']:13.3f} {r['adaptive_median_s']:14.3f} "
                     f"{r['median_ratio']:6.3f} {r['uniform_mean_s']:14.3f} {r['adaptive_mean_s']:15.3f} "
                     f"{r['mean_ratio']:6.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="resnet18-fmnist,minilm-tweets")
    parser.add_argument("--batch", type=int, default=32, help="batch of every workload (default 32)")
    parser.add_argument("--resnet-batch", type=int, default=None, help="batch of resnet18-fmnist (e.g. 128)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--replan-every", type=int, default=10)
    parser.add_argument("--average", type=float, default=2.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for name in args.workloads.split(","):
        batch = args.resnet_batch if name == "resnet18-fmnist" and args.resnet_batch else args.batch
        results.append(run(name, batch, args.steps, args.warmup, args.replan_every, args.average))
        print(table(results[-1:]), flush=True)
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
