"""What daf.report shows for the project's ResNet-18 (CIFAR layout) after one training step.

python benchmarks/resnet_report.py [--bits 2] [--batch 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import daf
from daf.workloads.resnet import ResNet18


def run(bits: int = 2, batch: int = 64, group_size: int = 256) -> daf.Report:
    torch.manual_seed(0)
    model = daf.wrap(ResNet18(), bits=bits, group_size=group_size)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    F.cross_entropy(model(x), y).backward()
    return daf.report(model)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = run(args.bits, args.batch, args.group_size)
    print("\n".join(str(report).splitlines()[-6:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)


if __name__ == "__main__":
    main()
