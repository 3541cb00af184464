"""ResNet-18 (CIFAR layout) training-step time: fp32 against DAF (reference and native codec).

python benchmarks/resnet_step.py [--batch 64] [--bits 2] [--steps 7] [--warmup 2] [--background] [--json FILE]

Every variant is measured in the same run, interleaved step by step so that a change in
machine load hits them alike; figures are medians after warm-up. Hold the shared lock:
``flock /tmp/daf-cpu.lock python benchmarks/resnet_step.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import daf
from daf.kernels import native_status
from daf.workloads.resnet import ResNet18


def make_step(variant: str, bits: int, batch: int) -> Callable[[], None]:
    """One training step (forward, backward, SGD update) of a fresh ResNet-18 for ``variant``."""
    torch.manual_seed(0)
    model = ResNet18()
    if variant != "fp32":
        backend, _, mode = variant.partition("+")
        daf.wrap(model, bits=bits, backend=backend, background=(mode == "background"))
    return sgd_step(model, batch)


def sgd_step(model: torch.nn.Module, batch: int) -> Callable[[], None]:
    """One SGD step of ``model`` on a fixed random CIFAR-sized batch (``torch.manual_seed`` set by the caller)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def run(variants: list[str], bits: int = 2, batch: int = 64, steps: int = 7, warmup: int = 2) -> dict:
    """Median step seconds per variant, interleaved round-robin after ``warmup`` steps each."""
    steppers = {v: make_step(v, bits, batch) for v in variants}
    for step in steppers.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(steps):
        for variant, step in steppers.items():
            start = time.perf_counter()
            step()
            times[variant].append(time.perf_counter() - start)
    medians = {v: statistics.median(t) for v, t in times.items()}
    return {"batch": batch, "bits": bits, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads(),
            "native_status": native_status(), "median_s": medians, "all_s": times,
            "vs_fp32": {v: medians[v] / medians["fp32"] for v in variants}}


def print_result(result: dict) -> None:
    print(f"\nResNet-18 CIFAR, batch {result['batch']}, {result['bits']} bits, {result['threads']} threads, "
          f"median of {result['steps']} steps after {result['warmup']} warm-up; kernels: {result['native_status']}")
    print(f"{'variant':<20}{'step ms':>10}{'vs fp32':>10}")
    for variant, seconds in result["median_s"].items():
        print(f"{variant:<20}{seconds * 1e3:>10.1f}{result['vs_fp32'][variant]:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--background", action="store_true", help="also measure native DAF with background packing")
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) reference codec")
    parser.add_argument("--json")
    args = parser.parse_args()
    variants = ["fp32", "native"] + ([] if args.no_reference else ["reference"])
    if args.background:
        variants.append("native+background")
    result = run(variants, args.bits, args.batch, args.steps, args.warmup)
    print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
