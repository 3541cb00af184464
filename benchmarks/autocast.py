"""Autocast's weight copies, derived instead of kept: one training step of MiniLM under bf16 autocast.

Under ``torch.autocast`` every matmul saves the bf16 copy of its weight for backward. DAF used to keep
those copies raw; now it derives them from the fp32 parameters in backward and stores nothing
(``daf.runtime.derived``). This measures one step at batch 32 (tweets of the minilm-tweets workload,
at most 64 tokens) on the pretrained MiniLM-L6 of that workload, in two setups: as the workload trains
it (LoRA r=8 on query/value, the head; the base weights are frozen) and fully fine-tuned (every weight
trains). Arms, each in a fresh process, a warm-up step on 2 of the sequences, then the measured step:

- ``fp32``: no autocast, no DAF (the reference gradient);
- ``autocast``: bf16 autocast, no DAF;
- ``daf2-before``: bf16 autocast, DAF 2 bits, the weight copies kept raw (the routing before
  derivation, restored by turning ``parameter_of_cast`` and ``frozen_parameter_of_cast`` off);
- ``daf2-after``: bf16 autocast, DAF 2 bits, the weight copies derived (frozen weights' too).

Figures: DAF's stored bytes (``daf.report``); from ``torch.profiler``'s memory events, the tensor bytes
allocated in the step that are alive when backward starts (what forward leaves for backward) and their
peak over the step (RSS after a warm-up hides what the step reuses from the allocator; the JSON has the
RSS figures too); and the gradient cosine against fp32 over the trainable parameters.

    PYTHONPATH=src python benchmarks/autocast.py --json docs/results/autocast.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ARMS = ("fp32", "autocast", "daf2-before", "daf2-after")
SETUPS = ("lora", "full")
_BACKWARD = "autocast-bench-backward"  # marks where forward ends in the profile


def _model(setup: str, workload: Any) -> nn.Module:
    """The workload's model (LoRA), or the same pretrained MiniLM with every weight trained."""
    if setup == "lora":
        return workload.build_model()
    from daf.workloads.minilm_tweets import minilm_dir
    from daf.workloads.packages import offline_transformers
    torch.manual_seed(workload.seed)
    model = offline_transformers().AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=3)
    return model.train()


def _step(model: nn.Module, workload: Any, batch: dict, autocast: bool) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = workload.loss(model, batch)
    with torch.profiler.record_function(_BACKWARD):
        loss.float().backward()


def run_arm(setup: str, arm: str, batch_size: int, out: str) -> None:
    """One arm in this process: writes its figures to ``out`` (JSON) and its gradient to ``out``.pt."""
    import importlib

    import daf
    from daf.workloads.measure import PeakRSS
    from daf.workloads.minilm_tweets import MiniLMTweets

    workload = MiniLMTweets(seed=0, train_size=batch_size)  # tokenize only the batch
    batch = next(iter(workload.batches(batch_size, 1)))
    model = _model(setup, workload)
    if arm.startswith("daf2"):
        model = daf.wrap(model, bits=2)
    if arm == "daf2-before":
        # the routing before derivation (the module, not the function daf.runtime re-exports under its name)
        route = importlib.import_module("daf.runtime.route")
        route.parameter_of_cast = lambda tensor: None
        route.frozen_parameter_of_cast = lambda tensor, arguments: None
    autocast = arm != "fp32"
    # Warm-up on 2 sequences: kernels and caches load, while the allocator keeps little of the step's
    # memory resident (a full-size warm-up would leave the measured step's peak inside retained memory).
    _step(model, workload, {key: value[:2] for key, value in batch.items()}, autocast)
    peak = PeakRSS()
    peak.reset()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        _step(model, workload, batch, autocast)
    seconds = time.perf_counter() - start
    peak_tensors, held = _tensor_bytes(profiler)
    figures: dict[str, Any] = {"setup": setup, "arm": arm, "step_peak_tensor_bytes": peak_tensors,
                               "held_after_forward_bytes": held,
                               "step_peak_rss_over_start": peak.peak() - peak.start, "peak_rss": peak.peak(),
                               "rss_resettable": peak.resettable, "step_s": seconds,
                               "tokens": list(batch["input_ids"].shape)}
    if arm.startswith("daf2"):
        report = daf.report(model)
        rows = [r for r in report.rows if r.kind == "derived"]
        copies = [r for r in report.rows if r.kind == "raw" and r.source in ("TBackward0", "ToCopyBackward0")]
        # frozen weights' copies have no autograd history: they are among these, with the input batch
        no_history = [r for r in report.rows if r.kind == "raw" and r.source == "no history"]
        figures.update(raw_bytes=report.raw_bytes, stored_bytes=report.stored_bytes, sites=report.totals()["sites"],
                       derived_bytes=sum(r.raw_bytes for r in rows), raw_weight_copy_bytes=sum(r.stored_bytes for r in copies),
                       raw_no_history_bytes=sum(r.stored_bytes for r in no_history))
    gradient = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    torch.save(gradient, out + ".pt")
    Path(out).write_text(json.dumps(figures))


def _tensor_bytes(profiler: Any) -> tuple[int, int]:
    """From the profiled step's memory events: the most bytes of tensors allocated in the step and alive at
    once (what the step needs, whatever the allocator keeps resident: RSS after a warm-up hides memory the
    step reuses), and those alive when backward starts (what forward leaves for backward: activations,
    DAF's records, the weight copies autograd holds)."""
    events = list(profiler.profiler.kineto_results.events())
    backward = min(e.start_ns() for e in events if e.name() == _BACKWARD)
    live = peak = 0
    at_backward = None
    for event in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if event.start_ns() >= backward and at_backward is None:
            at_backward = live
        live += event.nbytes()
        peak = max(peak, live)
    return peak, live if at_backward is None else at_backward


def _arm_in_subprocess(setup: str, arm: str, batch: int, threads: int, folder: str) -> tuple[dict, torch.Tensor]:
    out = f"{folder}/{setup}-{arm}.json"
    subprocess.run([sys.executable, __file__, "--arm", arm, "--setup", setup, "--batch", str(batch),
                    "--threads", str(threads), "--out", out], check=True)
    return json.loads(Path(out).read_text()), torch.load(out + ".pt")


def measure(batch: int, threads: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for setup in SETUPS:
            results = {arm: _arm_in_subprocess(setup, arm, batch, threads, folder) for arm in ARMS}
            reference = results["fp32"][1]
            for arm, (figures, gradient) in results.items():
                figures["cosine_vs_fp32"] = float(torch.nn.functional.cosine_similarity(
                    gradient.double(), reference.double(), dim=0))
                rows.append(figures)
            before, after = results["daf2-before"][1], results["daf2-after"][1]
            rows[-1]["gradient_equal_to_before"] = bool(torch.equal(before, after))
    return rows


def table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [f"{'setup':6} {'arm':12} {'stored MiB':>10} {'weight copies MiB':>18} {'no-history raw MiB':>18} "
             f"{'held at backward MiB':>20} {'step peak MiB':>13} {'cosine vs fp32':>14} {'step s':>7}"]
    for r in rows:
        stored = f"{r['stored_bytes'] / mib:.2f}" if "stored_bytes" in r else "-"
        copies = (f"{r['raw_weight_copy_bytes'] / mib:.2f} raw" if r.get("raw_weight_copy_bytes")
                  else f"{r['derived_bytes'] / mib:.2f} derived" if r.get("derived_bytes") else "-")
        no_history = f"{r['raw_no_history_bytes'] / mib:.2f}" if "raw_no_history_bytes" in r else "-"
        lines.append(f"{r['setup']:6} {r['arm']:12} {stored:>10} {copies:>18} {no_history:>18} "
                     f"{r['held_after_forward_bytes'] / mib:>20.1f} {r['step_peak_tensor_bytes'] / mib:>13.1f} {r['cosine_vs_fp32']:>14.6f} {r['step_s']:>7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child process
    parser.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.arm:
        run_arm(args.setup, args.arm, args.batch, args.out)
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = measure(args.batch, args.threads)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started": started, "torch": torch.__version__, "threads": args.threads, "batch": args.batch,
                       "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
