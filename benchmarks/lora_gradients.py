"""Relative error of the LoRA gradients, layer by layer, when each kind of save gets fewer bits.

A pretrained workload (``minilm-tweets`` or ``smollm-lora``) in training mode, dropout on and re-seeded
the same for fp32 and every method, its LoRA B matrices set to small random values (as after some
training: at their zero initialization the A matrices get no gradient). Per method, ``--batches``
batches of ``--batch``, each ``--rounding-seeds`` times (new rounding noise every pass), summed over all
passes: ||g - g_fp32|| / ||g_fp32|| over the LoRA
matrices of each layer, and the classifier head's (MiniLM). Cosine over all trainable parameters (as
``transformer_archs.py --sites`` reports) hides this: the head's gradient dominates the norm.

Methods: ``u<B>`` uniform B bits (``u<B>:<op>=<B>+...``: with ``Config.floors``, e.g.
``u2:layer_norm=4+scaled_dot_product_attention=4``); ``all8``; ``<kind><B>`` that kind at B bits and the rest at 8;
``<kind><B>+<kind><B>...`` those kinds at those bits and the rest at 2 (kinds: ``site_kinds.KINDS``).
Codec: ``--codec`` (the Outliers codec with GELU derivative codes by default, as MiniLM trains).

    python benchmarks/lora_gradients.py --methods u2,u4,all8,norm2,linear2,act2,softmax2,attn2 \
        --json docs/results/lora_gradients_minilm.json
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch import nn

import daf
from daf.config import Outliers
from daf.workloads import get_workload

sys.path.insert(0, str(Path(__file__).parent))
from site_kinds import KINDS, KindTable, module_kinds  # noqa: E402

CODECS = {"minmax": daf.MinMax(), "outliers": Outliers(), "outliers-derivatives": Outliers(derivatives=True)}


def method_config(name: str, kinds: tuple, codec: object) -> daf.Config:
    """``u<B>``, ``all8``, ``<kind><B>`` (rest at 8) or ``<kind><B>+...`` (rest at 2) as a Config."""
    uniform, _, floors = name.partition(":")
    if uniform.startswith("u") and uniform[1:].isdigit():
        pairs = [part.partition("=") for part in floors.split("+") if part]
        return daf.Config(bits=int(uniform[1:]), codec=codec, floors={op: int(b) for op, _, b in pairs})
    if name == "all8":
        return daf.Config(policy=KindTable((), 8, kinds), codec=codec)
    parts = [re.fullmatch(r"([a-z]+)(\d)", part) for part in name.split("+")]
    if not all(parts) or any(p.group(1) not in KINDS for p in parts):
        raise SystemExit(f"unknown method {name!r}: u<bits>, all8, <kind><bits> or <kind><bits>+...; kinds {KINDS}")
    table = tuple((p.group(1), int(p.group(2))) for p in parts)
    return daf.Config(policy=KindTable(table, 8 if len(parts) == 1 else 2, kinds), codec=codec)


def _group(name: str) -> str | None:
    if "classifier" in name:
        return "head"
    found = re.search(r"layers?\.(\d+)\..*lora_[AB]", name)
    return f"L{int(found.group(1)):02d}" if found else None


def _gradients(model: nn.Module, loss_of, batch, dropout_seed: int) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(dropout_seed)
    loss_of(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def measure(workload_name: str, methods: list[str], codec: str, batch: int, batches: int, seeds: int) -> dict:
    workload = get_workload(workload_name, seed=0)
    data = list(workload.batches(batch, batches))
    torch.manual_seed(0)
    base = workload.build_model().train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in base.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
    kinds = module_kinds(base)
    reference = [_gradients(base, workload.loss, b, 1234 + i) for i, b in enumerate(data)]
    results = {}
    for method in methods:
        model = copy.deepcopy(base)
        daf.wrap(model, method_config(method, kinds, CODECS[codec]))
        sums: dict[str, list[float]] = {}
        start = time.perf_counter()
        for i, (b, ref) in enumerate(zip(data, reference)):
            for _ in range(seeds):  # each pass draws new rounding noise (the seed advances per record)
                got = _gradients(model, workload.loss, b, 1234 + i)
                for name, g in ref.items():
                    group = _group(name)
                    if group is not None:
                        s = sums.setdefault(group, [0.0, 0.0])
                        s[0] += (got[name] - g).pow(2).sum().item()
                        s[1] += g.pow(2).sum().item()
        report = daf.report(model)
        results[method] = {"errors": {k: (v[0] / v[1]) ** 0.5 for k, v in sorted(sums.items())},
                           "stored_mib": report.stored_bytes / 2**20,
                           "seconds": time.perf_counter() - start}
        errors = results[method]["errors"]
        print(f"{method:24s} {results[method]['stored_mib']:7.2f} MiB  " +
              " ".join(f"{k} {v:.2f}" for k, v in errors.items()), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="minilm-tweets", choices=("minilm-tweets", "smollm-lora"))
    parser.add_argument("--methods", default="u2,u4,all8," + ",".join(f"{k}2" for k in KINDS))
    parser.add_argument("--codec", default="outliers-derivatives", choices=tuple(CODECS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--rounding-seeds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    results = measure(args.workload, methods, args.codec, args.batch, args.batches, args.rounding_seeds)
    if args.json:
        record = {"command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  "workload": args.workload, "codec": args.codec, "batch": args.batch, "batches": args.batches,
                  "rounding_seeds": args.rounding_seeds, "torch": torch.__version__, "methods": results}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
