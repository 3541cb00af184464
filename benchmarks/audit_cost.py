"""What the gradient audit (``daf.Audit``, on by default) costs, averaged over training, and what it finds.

One process, two copies of a workload's model under its DAF config (``daf.bench.methods.workload_config``):
one with the audit off (``Audit(every=0)``), one audited at every step (``Audit(every=1)``). Their steps
alternate; the audited copy's audit (every pass of the slice, all rounds) is timed apart. The averaged cost
of the default is ``audit seconds / (Audit().every * step seconds of the unaudited copy)``: an estimate from
measured parts, not a long run's step ratio (at every=50 a run of a few hundred steps holds a handful of
audits, and on a shared machine their time is below the noise of the steps). Also per step: the audit's
cosine (first round) and what it raised.

    PYTHONPATH=src python benchmarks/audit_cost.py --workload resnet18-fmnist --batch 64 --steps 6
    PYTHONPATH=src python benchmarks/audit_cost.py --workload minilm-tweets --batch 32 --steps 6

Without the Fashion-MNIST package, resnet18-fmnist runs on random images of its shape (timing only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import daf
from daf.bench.methods import workload_config
from daf.bench.overhead import timed_step
from daf.workloads import get_workload


def _batches(workload: Any, name: str, batch: int, steps: int) -> list[Any]:
    try:
        return list(workload.batches(batch, steps))
    except FileNotFoundError:
        if name != "resnet18-fmnist":
            raise
        generator = torch.Generator().manual_seed(0)
        return [(torch.randn(batch, 1, 28, 28, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
                for _ in range(steps)]


def measure(name: str, batch: int, steps: int, threads: int | None) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    workload = get_workload(name)
    batches = _batches(workload, name, batch, steps + 1)
    config = workload_config(name)
    models = {"off": workload.build_model(), "audited": workload.build_model()}
    daf.wrap(models["off"], config.replace(audit=daf.Audit(every=0)))
    daf.wrap(models["audited"], config.replace(audit=daf.Audit(every=1)))
    audit = models["audited"]._daf_attachment.audit
    audit_seconds: list[float] = []
    step = audit.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        if audit.running:  # the audit's own passes call the model again
            return step(*args, **kwargs)
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            audit_seconds.append(time.perf_counter() - start)

    audit.step = timed
    optimizers = {arm: workload.optimizer(model, steps + 1)[0] for arm, model in models.items()}
    rows = []
    for index, data in enumerate(batches):
        order = ("off", "audited") if index % 2 == 0 else ("audited", "off")
        row = {arm: timed_step(workload, models[arm], optimizers[arm], data) for arm in order}
        last = audit.last
        row.update(audit=audit_seconds[-1], cosine=last.before, after=last.after, raised=last.raised,
                   samples=last.samples)
        if index > 0:  # the first step builds caches and kernels
            rows.append(row)
    every = daf.Audit().every
    off, per_audit = statistics.median(r["off"] for r in rows), statistics.median(r["audit"] for r in rows)
    return {"workload": name, "batch": batch, "steps": steps, "threads": torch.get_num_threads(), "every": every,
            "step_off_s": off, "audit_s": per_audit, "audit_over_step": per_audit / off,
            "averaged_cost": per_audit / (every * off),
            "audited_step_less_audit_s": statistics.median(r["audited"] - r["audit"] for r in rows), "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['workload']} batch {result['batch']}, {result['threads']} thread(s), medians of "
             f"{result['steps']} steps after 1 warm-up"]
    for r in result["rows"]:
        lines.append(f"  step off {r['off']:.3f}s  audited {r['audited']:.3f}s  audit {r['audit']:.3f}s  "
                     f"{r['samples']} samples  cosine {r['cosine']:.4f} -> {r['after']:.4f}  raised {r['raised']}")
    lines.append(f"step, audit off: {result['step_off_s']:.3f}s; audited step less its audit: "
                 f"{result['audited_step_less_audit_s']:.3f}s; one audit: {result['audit_s']:.3f}s "
                 f"({100 * result['audit_over_step']:.1f}% of a step)")
    lines.append(f"averaged cost at every={result['every']}: {100 * result['averaged_cost']:.2f}% of a step (estimate)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = measure(args.workload, args.batch, args.steps, args.threads)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
