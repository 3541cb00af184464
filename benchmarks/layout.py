"""fp32 against DAF restoring as saved and DAF restoring channels-last: step time and tensor peak, one process.

python benchmarks/layout.py [--workload resnet18-fmnist] [--batch 128] [--rounds 8] [--warmup 2] [--bits 2]
                            [--threads 1] [--json FILE]

The three arms start from the same weights and train on the same batches, one step each per round, in
turn (so a change in the machine's load falls on all three). Per step: the thread's CPU time (what other
processes on the machine inflate least) and wall time, and the most tensor bytes alive above the step's
start (exact, from DAF's allocator). Printed: medians after warm-up, and each DAF arm over fp32 as the
median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

_MIB = 1 << 20
ARMS = {"fp32": None, "DAF as saved": False, "DAF channels-last": True}


def measure(workload_name: str, batch: int, rounds: int, warmup: int, bits: int) -> dict[str, Any]:
    from daf.allocator.native import install, tensor_bytes
    install("auto")
    import daf
    from daf.workloads import get_workload

    workload = get_workload(workload_name, eval_size=100)
    base = workload.build_model()
    models = {}
    for name, channels_last in ARMS.items():
        model = copy.deepcopy(base)
        if channels_last is not None:
            daf.wrap(model, bits=bits, channels_last=channels_last)
        models[name] = (model, workload.optimizer(model, rounds)[0])
    batches = list(workload.batches(batch, min(rounds, 4)))
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    for round_ in range(rounds):
        for name, (model, optimizer) in models.items():
            start = tensor_bytes(reset_peak=True).live_bytes
            cpu, wall = time.thread_time(), time.perf_counter()
            loss = workload.loss(model, batches[round_ % len(batches)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps[name].append({"cpu_s": time.thread_time() - cpu, "wall_s": time.perf_counter() - wall,
                                "peak_mib": (tensor_bytes().peak_bytes - start) / _MIB})
    return {name: figures[warmup:] for name, figures in steps.items()}


def summary(steps: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, figures in steps.items():
        row = {key: statistics.median(f[key] for f in figures) for key in ("cpu_s", "wall_s")}
        row["peak_mib"] = max(f["peak_mib"] for f in figures)
        if name != "fp32":
            for key in ("cpu_s", "wall_s"):
                row[f"{key}_ratio"] = statistics.median(a[key] / b[key] for a, b in zip(figures, steps["fp32"]))
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is the step's cost)")
    parser.add_argument("--json", help="write the steps and the summary to this file")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    steps = measure(args.workload, args.batch, args.rounds, args.warmup, args.bits)
    table = summary(steps)
    print(f"{args.workload}, batch {args.batch}, {args.bits} bits, {args.threads} thread(s), "
          f"{args.rounds - args.warmup} rounds after {args.warmup} of warm-up")
    print(f"{'arm':20} {'CPU s':>7} {'wall s':>7} {'x fp32 (CPU; wall)':>20} {'tensor peak MiB':>16}")
    for name, row in table.items():
        ratio = "" if name == "fp32" else f"{row['cpu_s_ratio']:.3f}; {row['wall_s_ratio']:.3f}"
        print(f"{name:20} {row['cpu_s']:7.3f} {row['wall_s']:7.3f} {ratio:>20} {row['peak_mib']:16.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "batch": args.batch, "bits": args.bits, "threads": args.threads,
                       "summary": table, "steps": steps}, f, indent=1)
        print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
