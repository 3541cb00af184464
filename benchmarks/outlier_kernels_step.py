"""A training step with the Outliers codec's native split/join against the same step on their statement.

Three copies of a workload's model (same weights, same batches) train step by step in turn: plain fp32,
``daf.wrap(model)`` (``Config()``, the default) on the native kernels, and ``daf.wrap(model)`` with
``daf.kernels.channel_ops.channel_split`` / ``channel_join`` replaced, during that arm's steps only, by
their plain-PyTorch statement (their default implementation: the codec as it was before the kernels,
bit for bit the same stores). The arms' order alternates from round to round. Per arm: the median step
time; per round: each DAF arm's step over fp32's of the same round, medians over rounds. One process, so
a machine whose load changes between runs (this one: 2 cores shared) moves all arms alike.

    python benchmarks/outlier_kernels_step.py --workload minilm-tweets --batch 32 --steps 10 --threads 1 \
        --json docs/results/outlier_kernels_step_minilm_20261128.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import daf
from daf.bench.overhead import timed_step
from daf.kernels import channel_ops
from daf.workloads import get_workload

_DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd
ARMS = ("fp32", "kernels", "statement")


@contextmanager
def statement_only():
    """The codec's split and join on their plain-PyTorch statement while inside."""
    split, join = channel_ops.channel_split, channel_ops.channel_join
    channel_ops.channel_split = lambda *a: torch.ops.daf.channel_split.default._op_dk(_DEFAULT, *a)
    channel_ops.channel_join = lambda *a: torch.ops.daf.channel_join.default._op_dk(_DEFAULT, *a)
    try:
        yield
    finally:
        channel_ops.channel_split, channel_ops.channel_join = split, join


def measure(workload_name: str, batch: int, steps: int, warmup: int, clock: str) -> dict:
    now = time.process_time if clock == "cpu" else time.perf_counter
    workload = get_workload(workload_name)
    batches = list(workload.batches(batch, warmup + steps))
    models = {arm: workload.build_model() for arm in ARMS}
    for arm in ("kernels", "statement"):
        daf.wrap(models[arm])
    optimizers = {arm: workload.optimizer(model, warmup + steps)[0] for arm, model in models.items()}
    rows = []
    for index, data in enumerate(batches):
        row = {}
        for arm in (ARMS if index % 2 == 0 else ARMS[::-1]):
            if arm == "statement":
                with statement_only():
                    row[arm] = timed_step(workload, models[arm], optimizers[arm], data, now)
            else:
                row[arm] = timed_step(workload, models[arm], optimizers[arm], data, now)
        if index >= warmup:
            rows.append(row)
    return {"workload": workload_name, "batch": batch, "steps": steps, "warmup": warmup, "clock": clock,
            "threads": torch.get_num_threads(), "config": daf.session_of(models["kernels"]).config.to_dict(),
            "median_s": {arm: statistics.median(r[arm] for r in rows) for arm in ARMS},
            "ratio_to_fp32": {arm: statistics.median(r[arm] / r["fp32"] for r in rows) for arm in ARMS[1:]},
            "kernels_over_statement": statistics.median(r["kernels"] / r["statement"] for r in rows), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="minilm-tweets")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.workload, args.batch, args.steps, args.warmup, args.clock)
    print(f"{args.workload} batch {args.batch}, daf.wrap(model) default, {args.steps} rounds after {args.warmup}, "
          f"{args.clock} clock, {result['threads']} thread(s)")
    for arm in ARMS:
        ratio = result["ratio_to_fp32"].get(arm)
        print(f"  {arm:10s} {1000 * result['median_s'][arm]:9.1f} ms" + (f"   x{ratio:.3f} fp32" if ratio else ""))
    print(f"  kernels / statement, median of rounds: {result['kernels_over_statement']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
