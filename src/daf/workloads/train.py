"""The training loop behind ``daf train`` and each arm of ``daf compare``.

``run_training(settings)`` builds the workload's model fresh from its seed, wraps it with DAF
unless the arm is fp32, trains it on the workload's fixed batch order, evaluates it on the
held-out split and returns a JSON-ready record: losses, step times, activation bytes raw and
stored (measured on one traced step), peak RSS during training, and a memory timeline of that step.
Ctrl-C stops training cleanly at the end of the current step (a second one at once): the record
says ``interrupted`` and holds what was measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from daf.allocator.native import install as install_allocator
from daf.allocator.native import decommit_freed_memory, huge_pages, release_free_memory
from daf.config import Config
from daf.workloads import get_workload
from daf.workloads.base import Workload
from daf.workloads.interrupt import StopRequest
from daf.workloads.measure import PeakRSS, SavedBytes, StepTimeline

__all__ = ["RunSettings", "run_training", "digest_batch"]

_WARMUP_STEPS = 2


@dataclass
class RunSettings:
    """One arm: the workload and its options, the length of the run, and the DAF config (None: fp32;
    its allocator is replaced by ``allocator``, which the fp32 arm uses too; ``decommit``, both arms:
    the allocator gives freed memory back at once, ``Config.decommit``).

    ``steps``/``batch`` of None take the workload's defaults; ``trace_step`` is the step whose
    activation bytes and memory timeline are recorded (the last step if the run is shorter).
    """

    workload: str
    options: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    batch: int | None = None
    daf: Config | None = None
    trace_step: int = 2
    progress: bool = True
    allocator: str = "auto"
    decommit: bool = False

    @property
    def arm(self) -> str:
        return "fp32" if self.daf is None else "daf"


def digest_batch(hasher: Any, batch: Any) -> None:
    """Feed every tensor of ``batch`` (a tensor, tuple/list or dict of tensors) into ``hasher``."""
    if isinstance(batch, torch.Tensor):
        hasher.update(batch.detach().contiguous().numpy().tobytes())
    elif isinstance(batch, dict):
        for key in sorted(batch):
            hasher.update(str(key).encode())
            digest_batch(hasher, batch[key])
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            digest_batch(hasher, item)


def _digest_parameters(model: nn.Module) -> str:
    hasher = hashlib.sha1()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            hasher.update(name.encode())
            hasher.update(parameter.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def _progress(total: int, description: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm
    interactive = sys.stderr.isatty()
    return tqdm(total=total, desc=description, disable=not enabled, unit="step", dynamic_ncols=True,
                mininterval=0.5 if interactive else 15.0, file=sys.stderr)


def _wrap(model: nn.Module, config: Config, allocator: str, decommit: bool) -> dict[str, Any]:
    import daf
    config = config.replace(allocator=allocator, decommit=decommit or config.decommit)
    daf.wrap(model, config)
    return config.to_dict()


def run_training(settings: RunSettings) -> dict[str, Any]:
    """Train one arm and return its record (see docs/results.md for the fields)."""
    workload: Workload = get_workload(settings.workload, **settings.options)
    steps = settings.steps or workload.default_steps
    batch = settings.batch or workload.default_batch
    started = time.time()
    record: dict[str, Any] = {
        "arm": settings.arm, "workload": workload.name, "options": workload.options(), "steps_requested": steps,
        "batch": batch, "seed": workload.seed, "metric": workload.metric, "higher_is_better": workload.higher_is_better,
        "interrupted": False, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    # Before any tensor of the run: both arms on the same allocator, or fp32 as a plain user runs it.
    record["allocator"] = dataclasses.asdict(install_allocator(settings.allocator))
    record["decommit"] = settings.decommit and decommit_freed_memory()  # fp32 too: the same memory regime
    record["huge_pages"] = huge_pages()
    load_start = time.perf_counter()
    model = workload.build_model()
    record["init_digest"] = _digest_parameters(model)
    record["config"] = None if settings.daf is None else _wrap(model, settings.daf, settings.allocator, settings.decommit)
    optimizer, schedule = workload.optimizer(model, steps)
    batches = workload.batches(batch, steps)
    first = next(batches)  # loads the data now, so that loading is not counted in step 0
    record["load_seconds"] = time.perf_counter() - load_start
    trace_step = min(settings.trace_step, steps - 1)
    losses: list[float] = []
    step_seconds: list[float] = []
    data_hash = hashlib.sha1()
    counter = SavedBytes()
    timeline = StepTimeline(_held_bytes(model, counter, settings.daf is not None))
    # What loading freed, both arms alike: tcmalloc (preloaded) would otherwise keep it in the peak
    record["released_before_training"] = release_free_memory()
    peak = PeakRSS()
    torch.manual_seed(workload.seed)  # dropout masks start from the same state in both arms
    with StopRequest() as stop:
        print(f"training {workload.name} ({settings.arm}): {steps} steps of batch {batch}", file=sys.stderr, flush=True)
        peak.reset()
        bar = _progress(steps, f"{workload.name} {settings.arm}", settings.progress)
        train_start = time.perf_counter()
        try:
            for step, data in enumerate(_chain(first, batches)):
                if stop.requested:
                    break
                digest_batch(data_hash, data)
                traced = step == trace_step
                if traced:
                    timeline.attach(model)
                start = time.perf_counter()
                if traced and settings.daf is None:
                    with counter.hooks(model):
                        loss = workload.loss(model, data)
                else:
                    loss = workload.loss(model, data)
                if traced:
                    timeline.mark("forward end")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if traced:
                    timeline.mark("backward end")
                optimizer.step()
                if schedule is not None:
                    schedule.step()
                step_seconds.append(time.perf_counter() - start)
                loss = loss.detach()
                if traced:
                    timeline.mark("optimizer end")
                    timeline.detach()
                    record["activations"] = _activations(model, counter, settings.daf is not None)
                losses.append(loss.item())
                del loss
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
        except KeyboardInterrupt:
            record["interrupted"] = True
            timeline.detach()
        finally:
            bar.close()
    record["interrupted"] = record["interrupted"] or stop.requested
    record["train_seconds"] = time.perf_counter() - train_start
    record["peak_rss_bytes"] = peak.peak()
    record["start_rss_bytes"] = peak.start
    record["peak_rss_resettable"] = peak.resettable
    record.update(steps_done=len(losses), losses=losses, step_seconds=step_seconds,
                  median_step_seconds=_median_step(step_seconds, trace_step),
                  data_digest=data_hash.hexdigest(), timeline=timeline.to_dict())
    record.setdefault("activations", None)
    record["activations_last_step"] = _last_step(model) if settings.daf is not None and losses else None
    record["eval"] = _evaluate(workload, model, record)
    record["wall_seconds"] = time.time() - started
    return record


def _chain(first: Any, rest: Any) -> Any:
    yield first
    yield from rest


def _held_bytes(model: nn.Module, counter: SavedBytes, wrapped: bool) -> Any:
    if not wrapped:
        return lambda: counter.live
    import daf
    store = daf.session_of(model).store
    return lambda: store.stats().get("bytes_in_use", 0)


def _activations(model: nn.Module, counter: SavedBytes, wrapped: bool) -> dict[str, Any]:
    if not wrapped:
        return {"raw_bytes": counter.total, "stored_bytes": counter.total, "ratio": 1.0}
    import daf
    report = daf.report(model)
    return {"raw_bytes": report.raw_bytes, "stored_bytes": report.stored_bytes, "ratio": report.ratio,
            "mean_code_bits": report.mean_code_bits, "sites": report.totals()["sites"],
            "store": report.sections.get("store", {})}


def _last_step(model: nn.Module) -> dict[str, Any]:
    """The last step's stored bytes and the policy's state then: an adaptive plan starts after the traced
    step (its first plan is made at step ``replan_every``), so the traced figures show uniform bits."""
    import daf
    report = daf.report(model)
    return {"raw_bytes": report.raw_bytes, "stored_bytes": report.stored_bytes, "ratio": report.ratio,
            "mean_code_bits": report.mean_code_bits, "sites": report.totals()["sites"],
            "policy": report.sections.get("policy"), "audit": report.sections.get("audit")}


def _median_step(seconds: list[float], trace_step: int) -> float | None:
    timed = [s for i, s in enumerate(seconds) if i >= _WARMUP_STEPS and i != trace_step]
    timed = timed or seconds
    return statistics.median(timed) if timed else None


def _evaluate(workload: Workload, model: nn.Module, record: dict[str, Any]) -> dict[str, Any] | None:
    """Held-out figures; skipped (None) when no step ran or when Ctrl-C arrives during evaluation."""
    if not record["steps_done"]:
        return None
    print(f"evaluating {workload.name} ({record['arm']}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        figures = dict(workload.evaluate(model))
    except KeyboardInterrupt:
        record["interrupted"] = True
        return None
    figures["seconds"] = time.perf_counter() - start
    return figures
