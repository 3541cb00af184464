"""``resnet18-fmnist``'s model under ``daf.wrap(model)``: a ReLU output's nonzeros coded (the default since
2026-11-28) against dense 2-bit codes of the whole map (before), and fp32: step time, stored ratio, and one
gradient's error to fp32 over a few rounding draws.

    python benchmarks/nonzeros_step.py [--batch 128] [--steps 8] [--threads 1] [--json FILE]

The three copies start from the same weights; their forward+backward steps (no optimizer: the weights
stay) alternate in one process, order reversed every step, so that machine load hits them alike; medians
after the first step. "before" is the same default with ``policy.codes_nonzeros_only`` off.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import daf
from daf.workloads import get_workload

ARMS = {"fp32": None, "dense 2-bit codes (before)": False, "nonzeros coded (default)": True}


def _arm(base: torch.nn.Module, nonzeros: bool | None) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if nonzeros is not None:
        daf.wrap(model, audit=daf.Audit(every=0))
        daf.session_of(model).policy.codes_nonzeros_only = nonzeros
    return model


def _gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--draws", type=int, default=3, help="rounding draws for the gradient error")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    workload = get_workload("resnet18-fmnist", seed=0)
    base = workload.build_model()
    arms = {name: _arm(base, nonzeros) for name, nonzeros in ARMS.items()}
    batches = list(workload.batches(args.batch, args.steps + 1))
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i, (x, y) in enumerate(batches):
        for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            started = time.perf_counter()
            _gradient(arms[name], x, y, i)
            if i:
                times[name].append(time.perf_counter() - started)
    x, y = batches[0]
    exact = _gradient(arms["fp32"], x, y, 0)
    rows = {}
    for name, model in arms.items():
        errors = [float((_gradient(model, x, y, seed) - exact).norm() / exact.norm()) for seed in range(args.draws)]
        rows[name] = {"median_step_s": statistics.median(times[name]), "steps_s": times[name],
                      "relative_gradient_error": statistics.mean(errors), "errors": errors}
        if ARMS[name] is not None:
            report = daf.report(model)
            rows[name].update(ratio=report.ratio, stored_bytes=report.stored_bytes)
    fp32 = rows["fp32"]["median_step_s"]
    print(f"resnet18-fmnist, batch {args.batch}, {args.threads} thread(s), medians of {args.steps} steps")
    print(f"{'arm':28s} {'step s':>7s} {'x fp32':>7s} {'ratio':>6s} {'grad err':>8s}")
    for name, row in rows.items():
        print(f"{name:28s} {row['median_step_s']:7.3f} {row['median_step_s'] / fp32:7.3f} "
              f"{row.get('ratio', 1.0):6.2f} {row['relative_gradient_error']:8.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
