"""What remaking CNN blocks (``daf.runtime.remakes.blocks``, rule ``norm_block``) does to the stored ratio and
to one gradient, against the same model with the rule off (as before it existed).

Per model (random init) and configuration: the stored ratio (bytes autograd would keep / bytes DAF holds,
from ``daf.report``) and the gradient's cosine and relative error to plain autograd's, averaged over three
batches (``--batches``). The configurations:

- ``rule off``: ``daf.wrap(model)`` without the rule (the codes of each block's output, as before);
- ``default``: ``daf.wrap(model)``: the rule remakes where its records are finer than the save's width, and
  2-bit records through ReLU are not (the codes are kept; the report says why);
- ``norm inputs 4``: ``daf.wrap(model, floors={"batch_norm": 4, "group_norm": 4})``: the norms' inputs at 4
  bits, each block's output remade from them;
- ``2-bit remake``: the default with the rule taking 2-bit records as good enough (``NormBlockRule(lost_bits=0)``):
  the most the rule can save at today's widths, and the error that costs;
- ``split``: ``daf.wrap(model, split_norm_inputs=True)``: each norm input before a ReLU split by its mask
  (4-bit codes where it passes, group means elsewhere: ``daf.runtime.held``), the blocks remade from it.

    python benchmarks/block_remakes.py [--archs resnet,unet,unet-gn,convnext,resnet18] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import daf
from daf.runtime.remakes import DEFAULT_RULES, Remakes
from daf.runtime.remakes.blocks import NormBlockRule
from daf.workloads.resnet import ResNet18

sys.path.insert(0, str(Path(__file__).parent))
from default_safety import SmallUNet, cnn_archs, gradient  # noqa: E402
from transformer_archs import Arch, _image, archs  # noqa: E402

FLOORS = {"batch_norm": 4, "group_norm": 4}
CONFIGS = ("rule off", "default", "norm inputs 4", "2-bit remake", "split")


def _gn_silu_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.GroupNorm(4, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, 1, 1), nn.GroupNorm(4, cout), nn.SiLU())


class GroupNormUNet(SmallUNet):
    """The U-Net-style segmenter with group norm and SiLU (a diffusion model's blocks)."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__(width, classes)
        self.down1, self.down2 = _gn_silu_block(3, width), _gn_silu_block(width, 2 * width)
        self.bottom = _gn_silu_block(2 * width, 4 * width)
        self.dec2, self.dec1 = _gn_silu_block(4 * width, 2 * width), _gn_silu_block(2 * width, width)


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return ResNet18(num_classes=10, in_channels=1).train()


def known_archs() -> dict[str, Arch]:
    cnns = cnn_archs()
    call = cnns["unet"].loss

    def gn_unet() -> nn.Module:
        torch.manual_seed(0)
        return GroupNormUNet().train()

    def fmnist(g: torch.Generator) -> dict:
        return {"x": torch.randn(128, 1, 28, 28, generator=g), "y": torch.randint(0, 10, (128,), generator=g)}

    return {**cnns, "unet-gn": Arch("unet-gn", gn_unet, cnns["unet"].batch, lambda m: m.down1, call),
            "convnext": archs("sdpa")["convnext"],
            "resnet18": Arch("resnet18", _resnet18, fmnist, lambda m: m.conv1,
                             lambda model, batch: F.cross_entropy(model(batch["x"]), batch["y"]))}


def wrap(model: nn.Module, config: str) -> nn.Module:
    daf.wrap(model, **({"floors": FLOORS} if config == "norm inputs 4" else {}),
             **({"split_norm_inputs": True} if config == "split" else {}))
    session = daf.session_of(model)
    if config == "rule off":
        session.remakes = Remakes([rule for rule in DEFAULT_RULES if rule.name != "norm_block"])
    elif config == "2-bit remake":
        session.remakes = Remakes([*[r for r in DEFAULT_RULES if r.name != "norm_block"], NormBlockRule(lost_bits=0)])
    return model


def measure(arch: Arch, batches: int) -> dict[str, dict[str, Any]]:
    """Each configuration on the same batches, alternated batch by batch."""
    base = arch.make()
    found: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
    for seed in range(batches):
        batch = arch.batch(torch.Generator().manual_seed(seed))
        reference = gradient(base, arch, batch)
        for config in CONFIGS:
            model = wrap(copy.deepcopy(base), config)
            g = gradient(model, arch, batch)
            report = daf.report(model)
            remade = sum(1 for row in report.rows if row.why.startswith("norm_block: remade"))
            found[config].append({"cosine": float(F.cosine_similarity(g, reference, dim=0)),
                                  "rel_error": float((g - reference).norm() / reference.norm()),
                                  "ratio": report.raw_bytes / max(report.stored_bytes, 1),
                                  "stored_bytes": report.stored_bytes, "remade": remade})
            daf.unwrap(model)
    return {config: {key: statistics.mean(row[key] for row in rows) for key in rows[0]} for config, rows in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="resnet,unet,unet-gn,convnext,resnet18")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    known = known_archs()
    results: dict[str, Any] = {}
    print(f"{'model':10s} {'configuration':14s} {'cosine':>7s} {'rel err':>8s} {'x off':>6s} {'ratio':>6s} {'remade':>6s}")
    for name in args.archs.split(","):
        started = time.perf_counter()
        results[name] = rows = measure(known[name], args.batches)
        off = rows["rule off"]["rel_error"]
        for config, row in rows.items():
            row["error_vs_rule_off"] = row["rel_error"] / off
            print(f"{name:10s} {config:14s} {row['cosine']:7.4f} {row['rel_error']:8.4f} {row['error_vs_rule_off']:6.2f} "
                  f"{row['ratio']:6.2f} {row['remade']:6.1f}", flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "batches": args.batches,
                                               "floors": FLOORS, "results": results}, indent=1))


if __name__ == "__main__":
    main()
