"""ResNet-18 (CIFAR layout) training-step time with the ``norm_block`` remake rule on and off, and fp32.

    python benchmarks/remake_step.py [--batch 64] [--steps 8] [--warmup 2] [--json FILE]

Variants, interleaved step by step in one process so that a change in machine load hits them alike
(figures: medians after warm-up): ``fp32``; ``rule off`` (``daf.wrap(model)`` without the rule: each
block's output coded, as before the rule); ``default`` (``daf.wrap(model)``: the rule asked for every
block's output, which keeps its codes at 2 bits); ``norm inputs 4`` (``floors={"batch_norm": 4}``: each
block's output remade in backward, a batch norm and ReLU recomputed per conv input); ``split``
(``split_norm_inputs=True``: each norm input before a ReLU split by its mask, the blocks remade from it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import daf
from daf.runtime.remakes import DEFAULT_RULES, Remakes
from daf.workloads.resnet import ResNet18
from resnet_step import sgd_step  # the sibling script: python puts benchmarks/ on the path

VARIANTS = ("fp32", "rule off", "default", "norm inputs 4", "split")


def make_step(variant: str, batch: int) -> tuple[Callable[[], None], torch.nn.Module]:
    torch.manual_seed(0)
    model = ResNet18()
    if variant != "fp32":
        daf.wrap(model, **({"floors": {"batch_norm": 4}} if variant == "norm inputs 4" else {}),
                 **({"split_norm_inputs": True} if variant == "split" else {}))
        if variant == "rule off":
            daf.session_of(model).remakes = Remakes([r for r in DEFAULT_RULES if r.name != "norm_block"])
    return sgd_step(model, batch), model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    steps = {v: make_step(v, args.batch) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.warmup + args.steps):
        for variant, (step, _) in steps.items():
            started = time.perf_counter()
            step()
            if i >= args.warmup:
                times[variant].append(time.perf_counter() - started)
    medians = {v: statistics.median(t) for v, t in times.items()}
    ratios = {v: steps[v][1] is not None and daf.report(steps[v][1]) if v != "fp32" else None for v in VARIANTS}
    rows = {}
    for variant in VARIANTS:
        report = ratios[variant]
        rows[variant] = {"median_s": medians[variant], "vs_fp32": medians[variant] / medians["fp32"],
                         "vs_rule_off": medians[variant] / medians["rule off"],
                         "ratio": None if report is None else report.raw_bytes / report.stored_bytes}
        ratio = "" if report is None else f"{rows[variant]['ratio']:6.2f}"
        print(f"{variant:14s} {medians[variant]:7.3f} s  x{rows[variant]['vs_fp32']:.3f} fp32  "
              f"x{rows[variant]['vs_rule_off']:.3f} rule off  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "batch": args.batch, "steps": args.steps,
                                               "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
