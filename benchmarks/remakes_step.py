"""What each remake rule costs in step time and saves in memory: ``daf.wrap(model)`` with all of them against
the same with some left out (``Config.remakes``), and plain fp32, in one process.

Copies of a workload's model (same weights, same batches) train step by step in turn: fp32, the default
(every rule), and one arm per ``--without`` (its comma-separated rules left out). The arms' order
alternates from round to round. Per arm: the median step, each round's step over fp32's of the same round
(median over rounds), the stored bytes of its last step (``daf.report``), and the cosine of its first
step's gradient (all trainable parameters) to fp32's, made from the same weights and batch.

    python benchmarks/remakes_step.py --workload smollm-lora --batch 8 --steps 8 \
        --without head_log_probabilities --json docs/results/remakes_step_smollm_20261128.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import daf
from daf.bench.overhead import timed_step
from daf.config import REMAKES, parse_remakes
from daf.workloads import get_workload


def _gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def arms_for(without: list[str]) -> dict[str, tuple[str, ...] | None]:
    """Arm name -> ``Config.remakes`` (None: fp32)."""
    arms: dict[str, tuple[str, ...] | None] = {"fp32": None, "all remakes": REMAKES}
    for left_out in without:
        names = parse_remakes(left_out)  # an unknown name is an error, not an arm equal to the default
        arms[f"without {left_out}"] = tuple(name for name in REMAKES if name not in names)
    return arms


def measure(workload_name: str, batch: int, steps: int, warmup: int, without: list[str], clock: str) -> dict:
    now = time.process_time if clock == "cpu" else time.perf_counter
    workload = get_workload(workload_name)
    batches = list(workload.batches(batch, warmup + steps))
    arms = arms_for(without)
    models = {arm: workload.build_model() for arm in arms}
    for arm, remakes in arms.items():
        if remakes is not None:
            daf.wrap(models[arm], remakes=remakes)
    optimizers = {arm: workload.optimizer(model, warmup + steps)[0] for arm, model in models.items()}
    rows, cosines = [], {}
    for index, data in enumerate(batches):
        order = list(arms) if index % 2 == 0 else list(arms)[::-1]
        row = {arm: timed_step(workload, models[arm], optimizers[arm], data, now) for arm in order}
        if index == 0:
            reference = _gradient(models["fp32"])
            cosines = {arm: float(F.cosine_similarity(_gradient(models[arm]), reference, dim=0)) for arm in arms
                       if arm != "fp32"}
        if index >= warmup:
            rows.append(row)
    daf_arms = [arm for arm in arms if arm != "fp32"]
    return {"workload": workload_name, "batch": batch, "steps": steps, "warmup": warmup, "clock": clock,
            "threads": torch.get_num_threads(), "remakes": {arm: arms[arm] for arm in daf_arms},
            "median_s": {arm: statistics.median(r[arm] for r in rows) for arm in arms},
            "ratio_to_fp32": {arm: statistics.median(r[arm] / r["fp32"] for r in rows) for arm in daf_arms},
            "stored_bytes": {arm: daf.report(models[arm]).stored_bytes for arm in daf_arms},
            "raw_bytes": {arm: daf.report(models[arm]).raw_bytes for arm in daf_arms},
            "first_step_gradient_cosine": cosines, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="smollm-lora")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--without", action="append", default=[], metavar="RULE[,RULE...]",
                        help=f"an arm without these rules (repeat for more arms); rules: {', '.join(REMAKES)}")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="wall")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.workload, args.batch, args.steps, args.warmup, args.without, args.clock)
    print(f"{args.workload} batch {args.batch}, {args.steps} rounds after {args.warmup}, {args.clock} clock, "
          f"{result['threads']} thread(s)")
    print(f"  {'arm':40s} {'step ms':>9s} {'x fp32':>7s} {'stored MiB':>11s} {'ratio':>6s} {'grad cos':>9s}")
    for arm, seconds in result["median_s"].items():
        if arm == "fp32":
            print(f"  {arm:40s} {1000 * seconds:9.1f}")
            continue
        stored, raw = result["stored_bytes"][arm], result["raw_bytes"][arm]
        print(f"  {arm:40s} {1000 * seconds:9.1f} {result['ratio_to_fp32'][arm]:7.3f} {stored / 2**20:11.1f} "
              f"{raw / max(stored, 1):6.2f} {result['first_step_gradient_cosine'][arm]:9.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
