"""RSS of a training process step by step: at each step's start, after its forward, at its end, and the
process's peak so far (``VmHWM``). Shows when a process settles (how many steps a memory probe needs) and
what a change does to the steady state rather than to the first steps.

python benchmarks/rss_by_step.py [--workload resnet18-fmnist] [--batch 512] [--steps 6] [--fp32] [--release]
    [--return-pages] [--norm-inputs codes|split] [--json FILE]

Where DAF installed its allocator in-process, each row also has the most tensor bytes alive during the forward
and during backward and the optimizer step (``daf.allocator.native.tensor_bytes``): the transients that RSS
shows only as a higher plateau. ``--norm-inputs split``: ``Config.split_norm_inputs`` (docs/architecture.md).

``--release``: ``daf.allocator.native.release_free_memory()`` after every step (the experiment of
docs/paging.md: does giving the allocators' free memory back between steps lower the peak?).
``--return-pages``: ``Config.return_pages`` (the pool gives its freed pages back at once).

Run it as the process you want to know about: the allocator is the one DAF installs in-process
(``Config.allocator="auto"``), or the one preloaded (``daf run -- python benchmarks/rss_by_step.py ...``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from typing import Any

_MIB = 1 << 20


def measure(workload_name: str, batch: int, steps: int, fp32: bool, release: bool = False,
            return_pages: bool = False, split: bool = False) -> list[dict[str, float]]:
    """One row per step: MiB of RSS at start, after forward, at the end, and the peak so far; the tensor peaks of
    the forward and of the rest of the step (None without DAF's allocator in-process)."""
    import daf
    from daf.allocator.native import release_free_memory, tensor_bytes
    from daf.workloads import get_workload
    from daf.workloads.measure import rss_bytes

    workload = get_workload(workload_name, eval_size=100)
    model = workload.build_model()
    if not fp32:
        daf.wrap(model, daf.Config(return_pages=return_pages, split_norm_inputs=split))
    optimizer, _ = workload.optimizer(model, steps)
    rows = []
    for data in workload.batches(batch, steps):
        start = rss_bytes()
        optimizer.zero_grad(set_to_none=True)
        tensor_bytes(reset_peak=True)
        loss = workload.loss(model, data)
        forward, forward_tensors = rss_bytes(), tensor_bytes(reset_peak=True)
        loss.backward()
        optimizer.step()
        del loss
        backward_tensors = tensor_bytes(reset_peak=True)
        if release:
            release_free_memory()
        rows.append({"start": start / _MIB, "after_forward": forward / _MIB, "end": rss_bytes() / _MIB,
                     "peak_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "forward_tensor_peak": forward_tensors.peak_bytes / _MIB if forward_tensors else None,
                     "backward_tensor_peak": backward_tensors.peak_bytes / _MIB if backward_tensors else None})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fp32", action="store_true", help="plain PyTorch instead of DAF 2-bit")
    parser.add_argument("--release", action="store_true", help="release the allocators' free memory after every step")
    parser.add_argument("--return-pages", action="store_true", help="Config.return_pages: the pool's freed pages "
                        "go back to the system at once")
    parser.add_argument("--norm-inputs", choices=("codes", "split"), default="codes",
                        help="split: Config.split_norm_inputs (norm inputs split by the ReLU mask after them)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = measure(args.workload, args.batch, args.steps, args.fp32, args.release, args.return_pages,
                   args.norm_inputs == "split")
    print(f"{args.workload}, batch {args.batch}, {'fp32' if args.fp32 else 'DAF'}: RSS and tensor peaks in MiB")
    print(f"{'step':>4} {'start':>8} {'forward':>8} {'end':>8} {'peak':>8} {'fwd tensors':>12} {'bwd tensors':>12}")
    for i, row in enumerate(rows):
        tensors = "".join(f" {value:12.0f}" if value is not None else f" {'-':>12}"
                          for value in (row["forward_tensor_peak"], row["backward_tensor_peak"]))
        print(f"{i:>4} {row['start']:8.0f} {row['after_forward']:8.0f} {row['end']:8.0f} {row['peak_so_far']:8.0f}"
              f"{tensors}")
    if args.json:
        result: dict[str, Any] = {"workload": args.workload, "batch": args.batch, "fp32": args.fp32,
                                  "release": args.release, "return_pages": args.return_pages,
                                  "norm_inputs": args.norm_inputs, "rows": rows,
                                  "argv": sys.argv}
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
