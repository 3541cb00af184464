"""``daf bench memory``: the largest batch that trains under a RAM cap, method by method.

Each probe is its own process (``daf.bench.probe``) that trains three steps at one batch size; it fits
when they finish with the process's peak RSS (``VmHWM``) under the cap. The parent watches the
child's RSS and kills it once it passes the cap, so a probe never runs far beyond it. The search
(``daf.bench.search``) grows the batch and then bisects. Output: a table, JSON and a PNG of peak
memory against step time at a common batch size (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daf.bench.methods import Method, methods_for
from daf.bench.search import largest_fitting
from daf.config import parse_size

__all__ = ["ProbeOutcome", "run_probe_process", "bench_workload", "add_arguments", "run", "format_table"]

_MIB = 1 << 20
_POLL_SECONDS = 0.02
# Start batches: small enough that every method fits on a laptop, large enough to time.
_START = {"resnet18-fmnist": 32, "minilm-tweets": 16, "smollm-lora": 2, "tiny-mnist": 128}
_WORKLOAD_OPTIONS = {"resnet18-fmnist": {"eval_size": 100}, "minilm-tweets": {"eval_size": 100},
                     "smollm-lora": {"eval_size": 20}, "tiny-mnist": {}}


@dataclass
class ProbeOutcome:
    """What one probe found: whether it fits, its peak RSS, its step times, and why it failed."""

    batch: int
    fits: bool
    peak_rss_bytes: int | None
    step_seconds: list[float]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "fits": self.fits, "peak_rss_bytes": self.peak_rss_bytes,
                "step_seconds": self.step_seconds, "reason": self.reason}


@contextlib.contextmanager
def _held(lock: str | None):
    """The shared CPU lock for one probe (step times mean nothing on a busy machine)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_probe_process(workload: str, method: Method, batch: int, steps: int, cap: int,
                      timeout: float, lock: str | None = None) -> ProbeOutcome:
    """Train ``steps`` steps at ``batch`` in a child process watched against ``cap`` bytes of RSS."""
    from daf.workloads.measure import rss_bytes
    spec = {"workload": workload, "options": _WORKLOAD_OPTIONS.get(workload, {}), "method": method.to_dict(),
            "batch": batch, "steps": steps}
    command = [sys.executable, "-m", "daf.bench.probe", json.dumps(spec)]
    with _held(lock):
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        started, killed = time.monotonic(), ""
        try:
            while process.poll() is None:
                if rss_bytes(process.pid) > cap:
                    killed = "over the cap"
                elif time.monotonic() - started > timeout:
                    killed = f"still running after {timeout:.0f} s"
                if killed:
                    os.killpg(process.pid, signal.SIGKILL)
                    break
                time.sleep(_POLL_SECONDS)
            stdout, stderr = process.communicate()
        finally:
            if process.poll() is None:  # interrupted: never leave a probe behind
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if killed:
        return ProbeOutcome(batch, False, None, [], killed)
    line = next((l for l in stdout.splitlines() if l.startswith("DAF-PROBE ")), None)
    if process.returncode != 0 or line is None:
        tail = (stderr.strip().splitlines() or ["no output"])[-1][:200]
        reason = "killed by the system (out of memory?)" if process.returncode == -signal.SIGKILL else tail
        return ProbeOutcome(batch, False, None, [], f"exit {process.returncode}: {reason}")
    result = json.loads(line[len("DAF-PROBE "):])
    peak = result["peak_rss_bytes"]
    fits = peak <= cap
    return ProbeOutcome(batch, fits, peak, result["step_seconds"], "" if fits else "peak RSS over the cap")


# Steps a probe trains. Three, not two: DAF's process may settle only in its third step (the page pool is
# rebuilt as one chunk after the first, and the allocator's heap takes a steady step's shape after the
# second): at batch 512 on resnet18-fmnist its peak after two steps was 7% (1244 against 1334 MiB) and,
# in another run, 9% below the plateau that steps 3-6 hold (benchmarks/rss_by_step.py); in a third
# run it was already there. fp32 settles in its first step; it is measured the same way.
PROBE_STEPS = 3


def bench_workload(workload: str, methods: list[Method], cap: int, start: int, resolution: float,
                   timeout: float, lock: str | None, log: Any = print,
                   on_method: Any = None) -> dict[str, Any]:
    """Each method's largest batch under ``cap``, with its probes, and its step time and peak RSS at
    ``start`` (the common batch: four steps there, the median of the last three timed).
    ``on_method(partial)`` is called after each method with the figures so far (a long run that is
    stopped keeps what it measured)."""
    results: list[dict[str, Any]] = []
    partial = {"workload": workload, "start": start, "resolution": resolution, "methods": results}
    for method in methods:
        outcomes: list[ProbeOutcome] = []

        def fits(batch: int, method: Method = method, outcomes: list = outcomes) -> tuple[bool, float | None]:
            steps = 4 if batch == start and not outcomes else PROBE_STEPS
            outcome = run_probe_process(workload, method, batch, steps, cap, timeout, lock)
            outcomes.append(outcome)
            timed = outcome.step_seconds[1:] or outcome.step_seconds
            log(f"  {workload} | {method.name} | batch {batch}: "
                + (f"fits, peak {outcome.peak_rss_bytes / _MIB:.0f} MiB, step {1000 * statistics.median(timed):.0f} ms"
                   if outcome.fits else f"no ({outcome.reason})"))
            return outcome.fits, outcome.peak_rss_bytes

        found = largest_fitting(fits, start=start, cap=cap, resolution=resolution)
        first = outcomes[0]
        at_start = {"step_ms": 1000 * statistics.median(first.step_seconds[1:]) if len(first.step_seconds) > 1
                    else None, "peak_rss_bytes": first.peak_rss_bytes} if first.batch == start and first.fits else None
        best = next((o for o in outcomes if o.fits and o.batch == found.batch), None)
        results.append({"method": method.to_dict(), "largest_batch": found.batch, "failed_at": found.failed_at,
                        "peak_rss_bytes": best.peak_rss_bytes if best else None, "at_start": at_start,
                        "probes": [o.to_dict() for o in outcomes]})
        if on_method is not None:
            on_method(partial)
    return partial


def format_table(bench: dict[str, Any]) -> str:
    """One row per method: largest batch, its ratio to fp32 on the system allocator and on DAF's,
    the peak RSS there, and step time and peak RSS at the common batch."""
    rows = bench["methods"]
    by_name = {r["method"]["name"]: r["largest_batch"] for r in rows}
    base_system, base = by_name.get("fp32 (system malloc)"), by_name.get("fp32")
    start = bench["start"]
    header = ["method", "largest batch", "x fp32 (system)", "x fp32", "peak RSS MiB",
              f"step ms @{start}", f"peak RSS MiB @{start}"]
    lines = [header]
    for r in rows:
        at = r["at_start"] or {}
        lines.append([r["method"]["name"], str(r["largest_batch"]),
                      f"{r['largest_batch'] / base_system:.2f}" if base_system else "-",
                      f"{r['largest_batch'] / base:.2f}" if base else "-",
                      f"{r['peak_rss_bytes'] / _MIB:.0f}" if r["peak_rss_bytes"] else "-",
                      f"{at['step_ms']:.0f}" if at.get("step_ms") else "-",
                      f"{at['peak_rss_bytes'] / _MIB:.0f}" if at.get("peak_rss_bytes") else "-"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def plot(benches: list[dict[str, Any]], path: Path, cap: int) -> Path:
    """Peak RSS against step time at each workload's common batch, one point per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(benches), figsize=(6.5 * len(benches), 5), squeeze=False)
    for axis, bench in zip(axes[0], benches):
        for r in bench["methods"]:
            at = r["at_start"]
            if not at or not at.get("step_ms"):
                continue
            axis.scatter(at["step_ms"], at["peak_rss_bytes"] / _MIB)
            axis.annotate(f"{r['method']['name']}\n(max batch {r['largest_batch']})",
                          (at["step_ms"], at["peak_rss_bytes"] / _MIB), fontsize=7,
                          textcoords="offset points", xytext=(4, 4))
        axis.set_xlabel(f"median step time at batch {bench['start']} (ms)")
        axis.set_ylabel(f"peak RSS at batch {bench['start']} (MiB)")
        axis.set_title(f"{bench['workload']} (cap {cap / _MIB:.0f} MiB)")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="resnet18-fmnist,minilm-tweets,smollm-lora",
                        help="comma-separated workloads (default: resnet18-fmnist,minilm-tweets,smollm-lora)")
    parser.add_argument("--cap", default="3GiB", help="the RAM cap on peak RSS (default 3GiB)")
    parser.add_argument("--methods", help="comma-separated method names to run (default: all)")
    parser.add_argument("--resolution", type=float, default=0.1,
                        help="stop when the gap between fit and no fit is this fraction of the fit (0.1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one probe may run (900)")
    parser.add_argument("--lock", help="a file to flock around each probe (a machine shared with other timings)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny-mnist, a 600MiB cap, three methods and a coarse search: about a minute")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--png", help="write the plot to this file")


def run(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the benchmark; ``command`` is the command line recorded in the JSON (default: from sys.argv)."""
    cap = parse_size(args.cap, "cap")
    workloads = args.workloads.split(",")
    resolution = args.resolution
    if args.quick:  # a smoke test of the whole path: three methods, a coarse search
        workloads, cap = ["tiny-mnist"], parse_size("600MiB", "cap") if args.cap == "3GiB" else cap
        resolution = max(resolution, 0.25)
    from daf.workloads import names
    unknown = [w for w in workloads if w not in names()]
    if unknown:
        raise SystemExit(f"daf bench memory: unknown workload(s) {unknown}; allowed: {', '.join(names())}")
    benches: list[dict[str, Any]] = []
    record = {"schema": "daf.bench.memory/1", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
              "cap_bytes": cap, "command": command or " ".join(["daf bench memory", *sys.argv[3:]]), "complete": False,
              "workloads": benches}

    def save(partial: dict[str, Any] | None = None) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            shown = benches + ([partial] if partial is not None and all(b is not partial for b in benches) else [])
            Path(args.json).write_text(json.dumps({**record, "workloads": shown}, indent=1))

    for workload in workloads:
        methods = methods_for(workload, cap, quick=args.quick)
        if args.methods:
            wanted = set(args.methods.split(","))
            methods = [m for m in methods if m.name in wanted]
        print(f"== {workload}: {len(methods)} methods, cap {cap / _MIB:.0f} MiB", file=sys.stderr, flush=True)
        bench = bench_workload(workload, methods, cap, _START.get(workload, 16), resolution, args.timeout,
                               args.lock, log=lambda text: print(text, file=sys.stderr, flush=True), on_method=save)
        benches.append(bench)
        print(f"\n{workload}: largest batch under {cap / _MIB:.0f} MiB of peak RSS")
        print(format_table(bench), flush=True)
    record["complete"] = True
    save()
    if args.json:
        print(f"figures: {args.json}")
    if args.png:
        print(f"plot: {plot(benches, Path(args.png), cap)}")
    return 0
