"""Process memory and step time of fp32 and DAF under each allocator: the measurement behind
``Config.allocator`` (docs/allocator.md).

python benchmarks/allocators.py [--workload resnet18-fmnist] [--batch 128] [--steps 10] [--json FILE]

Each cell is one ``daf train`` process (``--steps`` steps, evaluation on 200 images), run alone
and one after the other; "+train" is peak RSS (``VmHWM``) minus RSS when training starts, "peak"
the peak itself, step time the median of steps 3 to the end. Modes:

- system: the system's malloc (glibc), as a plain PyTorch user runs;
- NAME in-process: DAF makes NAME's library PyTorch's CPU allocator (``Config.allocator``,
  what ``daf.wrap`` does by default), the rest of the process stays on glibc;
- NAME preloaded: the whole process on NAME (``daf run --allocator NAME -- ...``);
- glibc mmap threshold: glibc with ``MALLOC_MMAP_THRESHOLD_=131072`` (large blocks unmapped when freed).

Hold the shared lock: ``flock /tmp/daf-cpu.lock python benchmarks/allocators.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daf.allocator import find_library, preload_env

_MIB = 1 << 20


def modes() -> list[tuple[str, str, dict[str, str]]]:
    """(label, --allocator value, extra environment) for every mode whose library is on this machine."""
    listed = [("system", "system", {})]
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if find_library(name) is not None:
            # daf train would start itself again with NAME preloaded: this variable says it already is
            listed.append((f"{name} in-process", name, {"DAF_TRAIN_PRELOADED": "1"}))
    if find_library("tcmalloc") is not None:
        listed.append(("tcmalloc preloaded", "system", preload_env("tcmalloc", environ={})))
    listed.append(("glibc mmap threshold", "system", {"MALLOC_MMAP_THRESHOLD_": "131072"}))
    return listed


def run_cell(workload: str, batch: int, steps: int, fp32: bool, allocator: str, env: dict[str, str]) -> dict[str, Any]:
    """One ``daf train`` process; its record's memory and time figures."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.json"
        command = [sys.executable, "-m", "daf.cli", "train", workload, "--steps", str(steps), "--batch", str(batch),
                   "-O", "eval_size=200", "--allocator", allocator, "--no-progress", "--no-plots", "--json", str(path)]
        if fp32:
            command.append("--fp32")
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
        run = next(iter(json.loads(path.read_text())["runs"].values()))
    return {"train_mib": (run["peak_rss_bytes"] - run["start_rss_bytes"]) / _MIB,
            "peak_mib": run["peak_rss_bytes"] / _MIB,
            "step_ms": 1000 * statistics.median(run["step_seconds"][3:] or run["step_seconds"]),
            "allocator": run["allocator"]}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--modes", help="comma-separated mode labels to run (default: every mode this machine has), "
                                        "e.g. 'system,tcmalloc in-process,tcmalloc preloaded'")
    args = parser.parse_args()
    rows = []
    chosen = modes()
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",")]
        unknown = sorted(set(wanted) - {label for label, _, _ in chosen})
        if unknown:
            parser.error(f"unknown --modes {unknown}; this machine has: {', '.join(label for label, _, _ in chosen)}")
        chosen = [mode for mode in chosen if mode[0] in wanted]
    for label, allocator, env in chosen:
        cells = {arm: run_cell(args.workload, args.batch, args.steps, arm == "fp32", allocator, env)
                 for arm in ("fp32", "daf")}
        rows.append({"mode": label, "env": env, **cells})
        print(f"  {label}: done", file=sys.stderr, flush=True)
    base = rows[0]["fp32"].get("train_mib")
    print(f"{args.workload}, batch {args.batch}, {args.steps} steps: +train MiB / peak MiB / step ms")
    print(f"{'allocator':22} {'fp32':>22} {'DAF 2-bit':>22}  DAF/fp32 +train  DAF/fp32(system) +train")
    for row in rows:
        cells = [row["fp32"], row["daf"]]
        text = ["error" if "error" in c else f"{c['train_mib']:.0f} / {c['peak_mib']:.0f} / {c['step_ms']:.0f}"
                for c in cells]
        same = "-" if any("error" in c for c in cells) else f"{cells[1]['train_mib'] / cells[0]['train_mib']:.2f}"
        system = "-" if "error" in cells[1] or not base else f"{cells[1]['train_mib'] / base:.2f}"
        print(f"{row['mode']:22} {text[0]:>22} {text[1]:>22}  {same:>15}  {system:>22}")
    for row in rows:
        for arm in ("fp32", "daf"):
            used = row[arm].get("allocator") or {}
            if row["mode"].endswith("in-process") and used.get("mode") != "in-process":
                print(f"note: {row['mode']} ({arm}) ran on {used.get('name')}: {used.get('reason')}")
    if args.json:
        record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "workload": args.workload,
                  "batch": args.batch, "steps": args.steps, "command": " ".join(sys.argv), "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
