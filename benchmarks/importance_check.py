"""The importance estimate against the truth: leave-one-in gradient error per site, ResNet-18 on Fashion-MNIST.

For every stored site, the squared error of the whole parameter gradient when only that site
is quantized (at ``--bits``) and every other saved tensor is kept exact, averaged over
``--seeds`` rounding seeds, next to the adaptive policy's estimate for that site after two
watched steps on the same batch. Also the cost of the best per-site plan computed from the
true figures (what any estimator could reach with per-tensor bits) against uniform bits.

    python benchmarks/importance_check.py [--width 16] [--batch 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

import daf
from daf.api import _ATTR, _Attachment
from daf.policy import AdaptivePolicy, Policy
from daf.policy.allocator import Site, allocate, variance_costs
from daf.runtime import Session


class _Only(Policy):
    """``bits`` at one site, raw everywhere else."""

    def __init__(self, site: str, bits: int) -> None:
        self.site, self.bits = site, bits

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self.bits if site == self.site else 0


def _attach(model, config, policy) -> Session:
    session = Session(config, policy=policy)
    object.__setattr__(model, _ATTR, _Attachment(model, session))
    return session


def _gradient(model, x, y) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def run(width: int = 16, batch: int = 32, bits: int = 2, seeds: int = 2, average: float = 2.0) -> dict:
    from daf.workloads.fashion_mnist import load_fashion_mnist
    from daf.workloads.resnet import ResNet18

    images, labels = load_fashion_mnist("train")
    idx = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[:batch]
    x, y = images[idx], labels[idx]
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, in_channels=1, width=width)
    reference = _gradient(model, x, y)
    policy = AdaptivePolicy(average, replan_every=1)
    _attach(model, daf.Config(bits=2), policy)
    for _ in range(2):
        _gradient(model, x, y)
    policy.estimator.fold()
    daf.unwrap(model)
    rows = {}
    for site, stats in policy.estimator.sites.items():
        costs = policy.estimator.costs(site)
        errors = []
        for seed in range(seeds):
            _attach(model, daf.Config(bits=2, seed=seed), _Only(site, bits))
            errors.append(float((_gradient(model, x, y) - reference).square().sum()))
            daf.unwrap(model)
        rows[site] = {"numel": stats.numel, "true": statistics.fmean(errors),
                      "estimate": None if costs is None else costs[bits]}
    ratios = [math.log10(r["true"] / r["estimate"]) for r in rows.values() if r["estimate"] and r["true"] > 0]
    sites = [Site(s, -(-r["numel"] // 256) * 256, variance_costs(r["true"] * ((1 << bits) - 1) ** 2, raw=True))
             for s, r in rows.items()]
    best = allocate(sites, average)
    return {"rows": rows, "log10_ratio_mean": statistics.fmean(ratios), "log10_ratio_sd": statistics.pstdev(ratios),
            "uniform_true_cost": sum(r["true"] for r in rows.values()), "best_plan_true_cost": best.cost,
            "gradient_norm_squared": float(reference.square().sum()), "bits": bits, "average": average}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = run(args.width, args.batch, seeds=args.seeds)
    for site, r in result["rows"].items():
        estimate = "-" if r["estimate"] is None else f"{r['estimate']:.3g}"
        ratio = "-" if not r["estimate"] else f"{r['true'] / r['estimate']:.2f}"
        print(f"{site:28s} true {r['true']:9.3g}  estimate {estimate:>9s}  true/estimate {ratio:>6s}")
    print(f"log10(true/estimate): mean {result['log10_ratio_mean']:.2f}, sd {result['log10_ratio_sd']:.2f}")
    print(f"sum of true costs: uniform 2 bits {result['uniform_true_cost']:.4g}; best per-site plan at "
          f"{result['average']} bits on average {result['best_plan_true_cost']:.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
