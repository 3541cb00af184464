"""Training under a memory budget of a quarter of the 2-bit stored size: loss curves against the unconstrained run.

python benchmarks/budget_training.py [--steps 200] [--width 8] [--batch 32] [--fraction 0.25] [--json out.json]

A small CNN (the project's ResNet-18 at width 8, 0.18 M parameters, 1-channel stem) trains on
Fashion-MNIST (SGD, momentum 0.9, lr 0.05, seed 0, same batches for every run): fp32, DAF at
2 bits without a budget, and DAF at 2 bits under ``--fraction`` of the store's high-water
mark of the unconstrained 2-bit run, once spilling only (min_bits=2, the default) and once
demoting to 1 bit before spilling (min_bits=1). Prints the mean loss per window of steps, the
largest gap to the unconstrained 2-bit curve, test accuracy on 2000 held-out images,
seconds per step and, for each budgeted run, the store section of ``daf.report``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import daf
from daf.workloads.fashion_mnist import load_fashion_mnist
from daf.workloads.resnet import ResNet18


def train(steps: int, width: int, batch: int, data, config: dict | None) -> dict:
    """One run; ``config`` None trains in fp32."""
    (x_train, y_train), (x_test, y_test) = data
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, in_channels=1, width=width)
    if config is not None:
        daf.wrap(model, **config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = torch.randperm(x_train.shape[0], generator=torch.Generator().manual_seed(0))
    losses = []
    started = time.perf_counter()
    for step in range(steps):
        index = order[(step * batch) % len(order):][:batch]
        loss = F.cross_entropy(model(x_train[index]), y_train[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = (time.perf_counter() - started) / steps
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    result = {"losses": losses, "seconds_per_step": seconds, "test_accuracy": accuracy}
    if config is not None:
        result["store"] = daf.report(model).sections["store"]
        result["report"] = [line for line in str(daf.report(model)).splitlines()
                            if line.startswith(("activations:", "store:"))]
    return result


def run(steps: int = 200, width: int = 8, batch: int = 32, fraction: float = 0.25) -> dict[str, dict]:
    x_train, y_train = load_fashion_mnist("train")
    x_test, y_test = load_fashion_mnist("test")
    data = ((x_train, y_train), (x_test[:2000], y_test[:2000]))
    results = {"fp32": train(steps, width, batch, data, None)}
    results["2-bit"] = train(steps, width, batch, data, {"bits": 2, "page_size": 4096})
    budget = int(results["2-bit"]["store"]["high_water_bytes"] * fraction)
    for min_bits in (2, 1):
        config = {"bits": 2, "page_size": 4096, "budget": budget, "min_bits": min_bits}
        results[f"budget min_bits={min_bits}"] = train(steps, width, batch, data, config)
    return results


def table(results: dict[str, dict], window: int = 20) -> str:
    base = results["2-bit"]["losses"]
    steps = len(base)
    window = min(window, steps)
    header = ["run"] + [f"{s}-{s + window}" for s in range(0, steps, window)] + ["max gap", "test acc", "s/step"]
    rows = [header]
    for name, result in results.items():
        losses = result["losses"]
        means = [sum(losses[s:s + window]) / len(losses[s:s + window]) for s in range(0, steps, window)]
        base_means = [sum(base[s:s + window]) / len(base[s:s + window]) for s in range(0, steps, window)]
        gap = max(abs(a - b) for a, b in zip(means, base_means))
        rows.append([name] + [f"{m:.3f}" for m in means] +
                    [f"{gap:.3f}", f"{result['test_accuracy']:.3f}", f"{result['seconds_per_step']:.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"(mean loss per window of {window} steps; max gap: largest |window mean - 2-bit window mean|)")
    for name, result in results.items():
        if "budget" in name:
            lines.append(f"{name}:")
            lines.extend("  " + line for line in result["report"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(args.steps, args.width, args.batch, args.fraction)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
