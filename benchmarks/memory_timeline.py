"""Memory of one training step, module by module: live tensor bytes (exact, from DAF's allocator)
and RSS, fp32 against DAF, each in its own process. Shows what DAF adds beyond the ideal.

python benchmarks/memory_timeline.py [--workload resnet18-fmnist] [--batch 128] [--bits 2] [--json FILE]

After three warm-up steps, one step is traced: before and after every leaf module's forward and
backward, the bytes of live CPU tensors and the most that were alive since the previous sample
(``daf.allocator.native.tensor_bytes``, so the allocator is DAF's in both arms), and RSS. Printed:
the peak of each arm and where it happens, the events where DAF's peak passes fp32's (DAF's own
transients), and the ideal (docs/memory.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

_MIB = 1 << 20


def trace(workload_name: str, batch: int, bits: int | None) -> dict[str, Any]:
    """One traced step of one arm in this process (call in a fresh process: the allocator is process-wide)."""
    from daf.allocator.native import install, tensor_bytes
    install("auto")
    import torch

    import daf
    from daf.workloads import get_workload
    from daf.workloads.measure import rss_bytes

    workload = get_workload(workload_name, eval_size=100)
    model = workload.build_model()
    if bits is not None:
        daf.wrap(model, bits=bits)
    optimizer, _ = workload.optimizer(model, 10)
    batches = list(workload.batches(batch, 4))

    def step(data: Any) -> None:
        loss = workload.loss(model, data)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for data in batches[:3]:
        step(data)
    events: list[tuple[str, int, int, int]] = []

    def mark(name: str) -> None:
        figures = tensor_bytes(reset_peak=True)
        events.append((name, figures.live_bytes, figures.peak_bytes, rss_bytes()))

    for name, module in model.named_modules():
        if next(module.children(), None) is None:
            module.register_forward_pre_hook(lambda m, a, n=name: mark(f"forward> {n}"))
            module.register_forward_hook(lambda m, a, o, n=name: mark(f"forward< {n}"))
            module.register_full_backward_pre_hook(lambda m, g, n=name: mark(f"backward> {n}"))
            module.register_full_backward_hook(lambda m, gi, go, n=name: mark(f"backward< {n}"))
    warnings.simplefilter("ignore")  # full backward hooks on modules whose inputs need no grad
    mark("start")
    loss = workload.loss(model, batches[3])
    mark("forward end")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    mark("backward end")
    optimizer.step()
    mark("optimizer end")
    stored = daf.report(model).stored_bytes if bits is not None else 0
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"events": events, "stored_bytes": stored, "parameter_bytes": parameters}


def _arm(args: argparse.Namespace, bits: int | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--workload", args.workload, "--batch", str(args.batch)]
    if bits is not None:
        command += ["--bits", str(bits)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(fp32: dict[str, Any], compressed: dict[str, Any], top: int = 6) -> str:
    """The peaks, the ideal and DAF's largest excesses over fp32 at the same event."""
    lines = []
    start = {arm: run["events"][0][1] for arm, run in (("fp32", fp32), ("daf", compressed))}
    for arm, run in (("fp32", fp32), ("daf", compressed)):
        name, _, peak, _ = max(run["events"][1:], key=lambda e: e[2])
        rss = max(e[3] for e in run["events"]) - run["events"][0][3]
        lines.append(f"{arm:5} tensor peak {(peak - start[arm]) / _MIB:7.1f} MiB above the step's start "
                     f"(at {name}); RSS grew {rss / _MIB:.1f} MiB during the step")
    gradients = 2 * compressed["parameter_bytes"]  # new gradients and the optimizer's state
    lines.append(f"stored activations {compressed['stored_bytes'] / _MIB:.1f} MiB (DAF's page pool: a mapping of "
                 f"its own, not in the tensor bytes); gradients and momentum {gradients / _MIB:.1f} MiB")
    excess = []
    for (name, _, peak_f, _), (name_d, _, peak_d, _) in zip(fp32["events"], compressed["events"]):
        if name == name_d:
            excess.append(((peak_d - start["daf"]) - (peak_f - start["fp32"]), name))
    excess.sort(reverse=True)
    lines.append("where DAF's tensors pass fp32's (MiB, interval ending at the event):")
    lines += [f"  {delta / _MIB:+7.1f}  {name}" for delta, name in excess[:top] if delta > 0] or ["  nowhere"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--bits", type=int)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write both timelines to this file")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(trace(args.workload, args.batch, args.bits)))
        return 0
    fp32, compressed = _arm(args, None), _arm(args, args.bits or 2)
    print(f"{args.workload}, batch {args.batch}: one traced step after three warm-up steps")
    print(f"{'event':40} {'fp32 live':>10} {'peak':>7} {'DAF live':>10} {'peak':>7}   (MiB above the step's start)")
    f0, d0 = fp32["events"][0][1], compressed["events"][0][1]
    for (name, live_f, peak_f, _), (_, live_d, peak_d, _) in zip(fp32["events"], compressed["events"]):
        print(f"{name:40} {(live_f - f0) / _MIB:10.1f} {(peak_f - f0) / _MIB:7.1f} "
              f"{(live_d - d0) / _MIB:10.1f} {(peak_d - d0) / _MIB:7.1f}")
    print()
    print(summarize(fp32, compressed))
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": args.workload, "batch": args.batch,
                                               "fp32": fp32, "daf": compressed}))
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
