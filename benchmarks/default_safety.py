"""What ``daf.wrap(model)`` with no other argument does to one gradient, on models DAF was not tuned on.

Held-out architectures at random init (Hugging Face GPT-2, BERT, T5, Llama, ViT, ConvNeXt configs with
their default attention, ``sdpa``; two CNNs of our own: a ResNet-style net with batch norm and a
U-Net-style one), each plain and with **large channels**: two channels of every norm's weight scaled
by 60, as trained transformers have (a few residual channels hundreds of times the rest). Per case:
the cosine of the gradient (all parameters, concatenated) to plain autograd's on the same batch, and
the stored ratio (bytes autograd would keep / bytes DAF holds, from ``daf.report``).

    python benchmarks/default_safety.py                                   # daf.wrap(model)
    python benchmarks/default_safety.py --config bits=8,rounding=nearest  # the 8-bit check
    python benchmarks/default_safety.py --json docs/results/default_safety.json
    python benchmarks/default_safety.py --compile                        # torch.compile(daf.wrap(model))
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import daf

sys.path.insert(0, str(Path(__file__).parent))
from transformer_archs import Arch, _image, archs  # noqa: E402

LARGE_SCALE = 60.0
LARGE_CHANNELS = 2


class ResBlock(nn.Module):
    def __init__(self, channels: int, stride: int = 1) -> None:
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.short = nn.Sequential() if stride == 1 else nn.Sequential(
            nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    """A ResNet-style classifier: stem, four residual blocks (two downsampling), pooling, head."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(ResBlock(width), ResBlock(width, 2), ResBlock(2 * width), ResBlock(2 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(pixel_values))
        return F.cross_entropy(self.head(h.mean((2, 3))), labels)


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU())


class SmallUNet(nn.Module):
    """A U-Net-style segmenter: two downsampling levels, transposed-conv upsampling, skip concatenation."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.down1, self.down2 = _conv_block(3, width), _conv_block(width, 2 * width)
        self.bottom = _conv_block(2 * width, 4 * width)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, 2), _conv_block(4 * width, 2 * width)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * width, width, 2, 2), _conv_block(2 * width, width)
        self.out = nn.Conv2d(width, classes, 1)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(pixel_values)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return F.cross_entropy(self.out(u1), labels)


def _segmentation(batch: int, size: int, classes: int) -> Callable[[torch.Generator], dict]:
    def make(g: torch.Generator) -> dict:
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                "labels": torch.randint(0, classes, (batch, size, size), generator=g)}
    return make


def _seeded(cls: type) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return cls().train()
    return make


def cnn_archs() -> dict[str, Arch]:
    call = lambda model, batch: model(**batch)  # noqa: E731 - the model returns its loss
    return {"resnet": Arch("resnet", _seeded(SmallResNet), _image(16, 32), lambda m: m.stem, call),
            "unet": Arch("unet", _seeded(SmallUNet), _segmentation(4, 64, 4), lambda m: m.down1, call)}


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def with_large_channels(model: nn.Module) -> nn.Module:
    """Scale ``LARGE_CHANNELS`` channels of every norm's weight by ``LARGE_SCALE`` (LayerNorm, batch and group
    norms, and any module called ``*Norm`` with a ``weight``: RMSNorm, T5's and Llama's norms)."""
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            norm = isinstance(module, _NORMS) or type(module).__name__.endswith("Norm")
            if norm and isinstance(weight, torch.Tensor) and weight.dim() == 1:
                weight[:LARGE_CHANNELS] *= LARGE_SCALE
    return model


def gradient(model: nn.Module, arch: Arch, batch: Any, call: Any = None) -> torch.Tensor:
    """The gradient of all of ``model``'s parameters, concatenated; ``call``: what runs it (a compiled
    ``model``), else ``model``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    arch.loss(model if call is None else call, batch).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
                      for p in model.parameters() if p.requires_grad])


def measure(arch: Arch, large: bool, config: dict[str, Any], steps: int, compiled: bool = False) -> dict[str, Any]:
    """Cosine of DAF's gradient to plain autograd's after ``steps - 1`` warm-up steps on the same batch (no
    optimizer step: the weights stay), and the stored ratio of the last. ``compiled``: the steps run
    ``torch.compile(daf.wrap(model))`` (inductor; at least two steps, the first compiles), against plain eager
    autograd's gradient, and the ratio is the compiled graphs' saves' (``daf.report``'s graph rows)."""
    base = arch.make()
    if large:
        with_large_channels(base)
    batch = arch.batch(torch.Generator().manual_seed(0))
    reference = gradient(base, arch, batch)
    model = copy.deepcopy(base)
    daf.wrap(model, **config)
    call = torch.compile(model) if compiled else None
    if compiled:
        torch._dynamo.reset()
        gradient(model, arch, batch, call)  # compiles
    started = time.perf_counter()
    for _ in range(steps):
        g = gradient(model, arch, batch, call)
    report = daf.report(model)
    daf.unwrap(model)
    return {"cosine": float(F.cosine_similarity(g, reference, dim=0)),
            "rel_error": float((g - reference).norm() / reference.norm()),
            "stored_bytes": report.stored_bytes, "raw_bytes": report.raw_bytes,
            "ratio": report.raw_bytes / max(report.stored_bytes, 1),
            "seconds": (time.perf_counter() - started) / steps}


def _parse_config(text: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        config[key] = int(value) if value.lstrip("-").isdigit() else value
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="gpt2,bert,t5,llama,vit,convnext,resnet,unet")
    parser.add_argument("--config", default="", help="keywords of daf.wrap, e.g. bits=8,rounding=nearest")
    parser.add_argument("--attention", default="sdpa", choices=("eager", "sdpa"))
    parser.add_argument("--steps", type=int, default=1, help="steps on the batch; the last is measured")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="torch.compile(daf.wrap(model)), inductor")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = _parse_config(args.config)
    known = {**archs(args.attention), **cnn_archs()}
    rows: dict[str, dict[str, Any]] = {}
    wrapped = f"daf.wrap(model{''.join(f', {k}={v!r}' for k, v in config.items())})"
    print(f"{f'torch.compile({wrapped})' if args.compile else wrapped}, attention {args.attention}")
    print(f"{'case':22s} {'cosine':>8s} {'rel err':>8s} {'ratio':>7s} {'stored MiB':>11s}")
    for name in args.archs.split(","):
        for large in (False, True):
            case = f"{name}{' +large' if large else ''}"
            rows[case] = row = measure(known[name], large, config, args.steps, args.compile)
            print(f"{case:22s} {row['cosine']:8.4f} {row['rel_error']:8.4f} {row['ratio']:7.2f} "
                  f"{row['stored_bytes'] / 2**20:11.2f}", flush=True)
    cosines = [r["cosine"] for r in rows.values()]
    ratios = [r["ratio"] for r in rows.values()]
    print(f"min cosine {min(cosines):.4f}, median stored ratio {statistics.median(ratios):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "daf_config": config, "compiled": args.compile,
                                               "attention": args.attention, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
