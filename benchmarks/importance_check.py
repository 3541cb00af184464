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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import daf
from daf.policy import Policy, register_policy
from daf.policy.allocator import Site, allocate, variance_costs


@dataclass(frozen=True)
class OnlySite:
    """Policy config: ``bits`` at ``site``, every other saved tensor raw."""

    site: str
    bits: int


class _Only(Policy):
    def __init__(self, site: str, bits: int) -> None:
        self.site, self.bits = site, bits

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self.bits if site == self.site else 0


@register_policy(OnlySite, kind="only-site")
def _only_site(config: daf.Config) -> Policy:
    return _Only(config.policy.site, config.policy.bits)


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
    daf.wrap(model, policy=daf.Adaptive(average=average, replan_every=1))
    policy = daf.session_of(model).policy  # an AdaptivePolicy: its estimator holds the estimates
    for _ in range(2):
        _gradient(model, x, y)
    policy.estimator.fold()
    # read before unwrap: what a session holds after it is done is not this benchmark's to rely on
    estimates = {site: (stats.numel, policy.estimator.costs(site)) for site, stats in policy.estimator.sites.items()}
    daf.unwrap(model)
    rows = {}
    for site, (numel, costs) in estimates.items():
        errors = []
        for seed in range(seeds):
            daf.wrap(model, policy=OnlySite(site, bits), seed=seed)
            errors.append(float((_gradient(model, x, y) - reference).square().sum()))
            daf.unwrap(model)
        rows[site] = {"numel": numel, "true": statistics.fmean(errors),
                      "estimate": None if costs is None else costs[bits]}
    ratios = [math.log10(r["true"] / r["estimate"]) for r in rows.values() if r["estimate"] and r["true"] > 0]
    sites = [Site(s, -(-r["numel"] // 256) * 256, variance_costs(r["true"] * ((1 << bits) - 1) ** 2, raw=True))
             for s, r in rows.items()]
    best = allocate(sites, average)
    return {"rows": rows, "log10_ratio_mean": statistics.fmean(ratios), "log10_ratio_sd": statistics.pstdev(ratios),
            "uniform_true_cost": sum(r["true"] for r in rows.values()), "best_plan_true_cost": best.cost,
            "gradient_norm_squared": float(reference.square().sum()), "bits": bits, "average": average}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
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
