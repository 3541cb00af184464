"""RSS of a training process step by step: at each step's start, after its forward, at its end, and the
process's peak so far (``VmHWM``). Shows when a process settles (how many steps a memory probe needs) and
what a change does to the steady state rather than to the first steps.

python benchmarks/rss_by_step.py [--workload resnet18-fmnist] [--batch 512] [--steps 6] [--fp32] [--release]
    [--return-pages] [--json FILE]

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
            return_pages: bool = False) -> list[dict[str, float]]:
    """One row per step: MiB of RSS at start, after forward, at the end, and the peak so far."""
    import daf
    from daf.allocator.native import release_free_memory
    from daf.workloads import get_workload
    from daf.workloads.measure import rss_bytes

    workload = get_workload(workload_name, eval_size=100)
    model = workload.build_model()
    if not fp32:
        daf.wrap(model, daf.Config(return_pages=return_pages))
    optimizer, _ = workload.optimizer(model, steps)
    rows = []
    for data in workload.batches(batch, steps):
        start = rss_bytes()
        optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(model, data)
        forward = rss_bytes()
        loss.backward()
        optimizer.step()
        del loss
        if release:
            release_free_memory()
        rows.append({"start": start / _MIB, "after_forward": forward / _MIB, "end": rss_bytes() / _MIB,
                     "peak_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
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
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = measure(args.workload, args.batch, args.steps, args.fp32, args.release, args.return_pages)
    print(f"{args.workload}, batch {args.batch}, {'fp32' if args.fp32 else 'DAF 2-bit'}: RSS in MiB")
    print(f"{'step':>4} {'start':>8} {'forward':>8} {'end':>8} {'peak':>8}")
    for i, row in enumerate(rows):
        print(f"{i:>4} {row['start']:8.0f} {row['after_forward']:8.0f} {row['end']:8.0f} {row['peak_so_far']:8.0f}")
    if args.json:
        result: dict[str, Any] = {"workload": args.workload, "batch": args.batch, "fp32": args.fp32,
                                  "release": args.release, "return_pages": args.return_pages, "rows": rows,
                                  "argv": sys.argv}
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
