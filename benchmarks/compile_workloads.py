"""The three workloads under torch.compile with DAF at 8 bits, nearest (issue 39): gradient cosine to compiled fp32.

python benchmarks/compile_workloads.py [--workloads resnet18-fmnist,minilm-tweets,smollm-lora] [--batch 8]
    [--backend inductor] [--default] [--json FILE]

Each workload's own model (pretrained weights and LoRA where it has them) and first batch, one step's gradient
of the trainable parameters three ways: ``torch.compile(m)``, ``torch.compile(daf.wrap(m, bits=8,
rounding="nearest"))`` and ``daf.wrap(torch.compile(m), ...)``, each from the same initial state (``--default``:
``daf.wrap(m)``'s own config, the audit off as in the 8-bit runs). Prints a
table of cosines and the graphs' stored ratio; no timings (compiling dominates).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import daf
from daf.workloads import get_workload

OPTIONS = {"resnet18-fmnist": {}, "minilm-tweets": {}, "smollm-lora": {"eval_size": 8}}


def _gradient(workload, model: torch.nn.Module, run: torch.nn.Module, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every variant (inductor draws its seeds from this generator)
    workload.loss(run, batch).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None])


def measure(name: str, batch_size: int, backend: str, default: bool = False) -> dict:
    workload = get_workload(name, **OPTIONS[name])
    base = workload.build_model()
    base.train()
    batch = next(iter(workload.batches(batch_size, 1)))
    config = dict(audit=daf.Audit(every=0)) if default else dict(bits=8, rounding="nearest", audit=daf.Audit(every=0))
    out = {"workload": name, "batch": batch_size}
    torch._dynamo.reset()
    plain = copy.deepcopy(base)
    reference = _gradient(workload, plain, torch.compile(plain, backend=backend), batch)
    for order in ("compile(wrap(m))", "wrap(compile(m))"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = (torch.compile(daf.wrap(model, **config), backend=backend) if order == "compile(wrap(m))"
               else daf.wrap(torch.compile(model, backend=backend), **config))
        grad = _gradient(workload, model, run, batch)
        wrapped = model if order == "compile(wrap(m))" else run  # what daf.wrap was given
        report = daf.report(wrapped)
        out[order] = {"cosine": float(torch.nn.functional.cosine_similarity(grad.double(), reference.double(), dim=0)),
                      "graph_ratio": round(report.ratio, 2)}
        daf.unwrap(wrapped)
        print(name, order, out[order], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(OPTIONS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--default", action="store_true", help="daf.wrap(m)'s default config instead of 8 bits")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(name, args.batch, args.backend, args.default) for name in args.workloads.split(",")]
    print(f"{'workload':>16} {'order':>18} {'grad cos':>10} {'graph ratio':>12}")
    for row in rows:
        for order in ("compile(wrap(m))", "wrap(compile(m))"):
            print(f"{row['workload']:>16} {order:>18} {row[order]['cosine']:>10.6f} {str(row[order]['graph_ratio']):>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/compile_workloads.py", "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
