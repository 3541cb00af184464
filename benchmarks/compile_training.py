"""A workload trained under ``torch.compile``, with and without DAF: the user's accuracy, not one gradient.

    python benchmarks/compile_training.py --arm fp32 --seed 0 --json docs/results/compile_training_fp32_seed0.json
    python benchmarks/compile_training.py --arm daf --seed 0 --json docs/results/compile_training_daf_seed0.json

One arm per process (its peak RSS is its own): the workload's model, data order, optimizer and schedule, as
``daf train`` uses them, with every training step run through ``torch.compile(model)`` (inductor) for ``fp32``
or ``torch.compile(daf.wrap(model))`` at the default config for ``daf``; evaluated eagerly at the end, as
``daf train`` evaluates. Prints the metric, the median step after the first (which compiles), the peak RSS and,
for DAF, the graphs' stored ratio (``daf.report``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

import daf
from daf.workloads import get_workload


def train(workload_name: str, arm: str, seed: int, steps: int | None, batch: int | None) -> dict:
    workload = get_workload(workload_name, seed=seed)
    steps = steps or workload.default_steps
    batch = batch or workload.default_batch
    model = workload.build_model()
    if arm == "daf":
        daf.wrap(model)
    run = torch.compile(model)
    optimizer, schedule = workload.optimizer(model, steps)
    torch.manual_seed(workload.seed)
    losses, seconds = [], []
    for data in workload.batches(batch, steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(run, data)
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
    result = {"workload": workload_name, "arm": arm, "seed": seed, "steps": steps, "batch": batch,
              "compiled": "inductor", "losses": losses, "step_seconds": seconds,
              "median_step_seconds": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
              "first_step_seconds": seconds[0], "eval": workload.evaluate(model),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if arm == "daf":
        report = daf.report(model)
        result["graph_ratio"] = report.ratio
        result["graph_rows"] = len(report.rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--arm", choices=("fp32", "daf"), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="default: the workload's")
    parser.add_argument("--batch", type=int, help="default: the workload's")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = train(args.workload, args.arm, args.seed, args.steps, args.batch)
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "step_seconds")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/compile_training.py", "args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main()
