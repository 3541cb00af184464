"""Where a DAF training step's extra time goes, per component: ``python -m daf.bench overhead``.

Two models of one workload (same weights, same batches) train step by step in turn, one
plain and one under ``daf.wrap``; a third runs plain under DAF's op tracker alone. The order of the
three alternates from round to round (fp32 first, then DAF first). The DAF
session's codecs, store and policy are wrapped in timers, and so are its two hooks. Per step:

- ``encode[NAME]`` / ``decode[TYPE]``: the codecs (``codes``, ``relu_mask``, ``mask``);
- ``store``: ``put``, ``get`` and ``release`` of the page pool;
- ``policy``: ``bits_for``, ``watch``, ``watch_op``, ``on_forward_start``;
- ``pack: routing and bookkeeping`` / ``unpack: rest``: the hooks' time less the above;
- ``op tracking``: the plain step under the tracker less the plain step (one Python call per
  torch function);
- ``audit``: the gradient audit (``daf.Audit``, docs/audit.md), all its passes; the mean per step, not
  the median, since most steps have none (run ``--steps`` past ``Audit.every`` to see one);
- ``unexplained``: DAF's step less fp32's less all of the above (hook dispatch in autograd,
  the allocator, caches).

Figures are medians over the measured steps, after warm-up; the JSON has every step.

``--clock cpu`` reads the process's CPU time instead of the wall clock. At one thread
(``--threads 1``) that is the work each arm does, whatever else the machine runs: a figure
taken beside other jobs still says where the time goes (cache and memory-bandwidth sharing
aside). The done-when targets are wall-clock figures on a quiet machine; ``cpu`` is for
finding the time, ``wall`` for reporting it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["measure", "main", "add_arguments", "timed_step", "step_ratio"]

_POLICY_METHODS = ("bits_for", "watch", "watch_op", "on_forward_start")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


class _Clock:
    """Seconds per label for the step in progress; a timer running inside an outer one (``outer=True``:
    the hooks) also adds its time to ``inner:<outer label>``, so the outer's own time can be told apart."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._outer: list[str] = []
        self._now = now

    def timed(self, label: Callable[..., str] | str, function: Callable, outer: bool = False) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            name = label(*args, **kwargs) if callable(label) else label
            if outer:
                self._outer.append(name)
            start = self._now()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = self._now() - start
                if outer:
                    self._outer.pop()
                elif self._outer:
                    self.seconds[f"inner:{self._outer[-1]}"] += elapsed
                self.seconds[name] += elapsed
        return run


class _Proxy:
    """``target`` with some methods timed; every other attribute is the target's."""

    def __init__(self, target: Any, methods: dict[str, Callable]) -> None:
        self._target, self._methods = target, methods

    def __getattr__(self, name: str) -> Any:
        return self._methods.get(name) or getattr(self._target, name)


def _instrument(session: Any, clock: _Clock) -> None:
    """Put timers around the session's codecs, store, policy and hooks (before its first forward)."""
    codecs, store, policy = session.codecs, session.store, session.policy
    session.codecs = _Proxy(codecs, {
        "encode": clock.timed(lambda name, *a, **k: f"encode[{name}]", codecs.encode),
        "decode": clock.timed(lambda packed, *a, **k: f"decode[{type(packed).__name__}]", codecs.decode),
        "decode_with_mask": clock.timed(lambda packed, *a, **k: f"decode[{type(packed).__name__}, with mask]",
                                        codecs.decode_with_mask),
        "encode_split": clock.timed("encode[split]", codecs.encode_split)})
    session.store = _Proxy(store, {m: clock.timed("store", getattr(store, m)) for m in ("put", "get", "release")})
    session.policy = _Proxy(policy, {m: clock.timed("policy", getattr(policy, m)) for m in _POLICY_METHODS})
    session.pack = clock.timed("pack (all)", session.pack, outer=True)
    session.unpack = clock.timed("unpack (all)", session.unpack, outer=True)


def timed_step(workload: Any, model: Any, optimizer: Any, batch: Any,
               now: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one training step (zero_grad, forward and backward of the workload's loss, optimizer step),
    by the clock ``now``."""
    start = now()
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model, batch).backward()
    optimizer.step()
    return now() - start


def measure(workload_name: str, batch: int, steps: int = 5, warmup: int = 2, options: dict | None = None,
            config: Any = None, clock: str = "wall") -> dict[str, Any]:
    """Per-component seconds of ``steps`` DAF steps against fp32 on ``workload_name`` (see module docstring),
    by the clock named ``clock`` ("wall" or "cpu")."""
    import torch

    import daf
    from daf.tracing import OpTracker
    from daf.workloads import get_workload

    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: expected one of {', '.join(CLOCKS)}")
    now = CLOCKS[clock]
    workload = get_workload(workload_name, **(options or {}))
    batches = list(workload.batches(batch, warmup + steps))
    models = {arm: workload.build_model() for arm in ("fp32", "tracker", "daf")}
    daf.wrap(models["daf"], config if config is not None else daf.Config())
    timers = _Clock(now)
    _instrument(daf.session_of(models["daf"]), timers)
    audit = models["daf"]._daf_attachment.audit
    if audit is not None:  # its own passes call the model, and so this timer, again: inner and tiny
        audit.step = timers.timed("audit", audit.step, outer=True)
    optimizers = {arm: workload.optimizer(model, warmup + steps)[0] for arm, model in models.items()}
    rows: list[dict[str, float]] = []
    for index, data in enumerate(batches):
        timers.seconds.clear()
        row: dict[str, float] = {}
        for arm in _turn_order(index):
            if arm == "tracker":
                with OpTracker(lambda call: None):
                    row[arm] = timed_step(workload, models[arm], optimizers[arm], data, now)
            else:
                row[arm] = timed_step(workload, models[arm], optimizers[arm], data, now)
        row.update(timers.seconds)
        if index >= warmup:
            rows.append(row)
    return {"workload": workload_name, "batch": batch, "steps": steps, "warmup": warmup, "clock": clock,
            "config": daf.session_of(models["daf"]).config.to_dict(),
            "threads": torch.get_num_threads(), "options": options or {}, "components": _components(rows), "step_ratio": step_ratio(rows), "rows": rows}


def _turn_order(index: int) -> tuple[str, ...]:
    """The arms of round ``index``: fp32 first in even rounds, DAF first in odd ones, so that neither
    always runs after the other (a step finds the caches and the allocator as the step before it left
    them; with a fixed order DAF always followed the tracker arm)."""
    order = ("fp32", "tracker", "daf")
    return order if index % 2 == 0 else order[::-1]


def _components(rows: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per step of each component (module docstring)."""
    def median(key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in rows)

    hooks = {"pack (all)", "unpack (all)", "inner:pack (all)", "inner:unpack (all)", "inner:audit"}
    labels = sorted({key for row in rows for key in row} - {"fp32", "tracker", "daf"} - hooks)
    out = {"fp32 step": median("fp32"), "DAF step": median("daf")}
    out.update({k: statistics.fmean(row.get(k, 0.0) for row in rows) if k == "audit" else median(k) for k in labels})
    # the hooks' own time: routing (two-value and nonzeros checks included), accounting, tables
    out["pack: routing and bookkeeping"] = statistics.median(
        row.get("pack (all)", 0.0) - row.get("inner:pack (all)", 0.0) for row in rows)
    out["unpack: rest (scatter, checks)"] = statistics.median(
        row.get("unpack (all)", 0.0) - row.get("inner:unpack (all)", 0.0) for row in rows)
    out["op tracking"] = statistics.median(row["tracker"] - row["fp32"] for row in rows)
    explained = sum(v for k, v in out.items() if k not in ("fp32 step", "DAF step"))
    out["unexplained"] = out["DAF step"] - out["fp32 step"] - explained
    return out


def step_ratio(rows: list[dict[str, float]]) -> float:
    """Median over steps of DAF's step time over fp32's in the same round: the two ran back to back,
    so a change in the machine's load between rounds cancels (medians of each arm do not)."""
    return statistics.median(row["daf"] / row["fp32"] for row in rows)


def table(result: dict[str, Any]) -> str:
    comps = result["components"]
    fp32 = comps["fp32 step"]
    config = result["config"]
    policy = config["policy"]
    kind = policy.get("kind") if isinstance(policy, dict) else policy
    daf_label = (f"DAF {config['bits']}-bit {config['codec']['kind']}" if config["bits"] is not None
                 else f"DAF {kind}") + (", pages returned" if config["return_pages"] else "")
    lines = [f"{result['workload']} batch {result['batch']} {result['options']}, {daf_label}: "
             f"medians of {result['steps']} steps "
             f"after {result['warmup']} warm-up, {result['clock']} clock, {result['threads']} thread(s)", f"{'component':34s} {'ms/step':>9s} {'% of fp32':>10s}"]
    for name, seconds in comps.items():
        lines.append(f"{name:34s} {1000 * seconds:9.1f} {100 * seconds / fp32:9.1f}%")
    lines.append(f"DAF / fp32, median over steps of each round's ratio: {result['step_ratio']:.3f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="resnet18-fmnist")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("-O", "--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a workload option, e.g. -O width=16")
    parser.add_argument("--bits", type=int, default=None,
                        help="DAF's code width (default: the workload's, with its codec: what keeps its result; "
                             "daf.bench.methods.workload_config)")
    parser.add_argument("--default", action="store_true",
                        help="daf.wrap(model)'s own config, Config() (the automatic choice per save), instead of "
                             "the workload's")
    parser.add_argument("--remakes", metavar="RULE,...|none",
                        help="Config.remakes: the remake rules in use, by name, or none (default: the config's, all)")
    parser.add_argument("--return-pages", action="store_true",
                        help="Config.return_pages: the pool gives freed pages back to the system at once")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: seconds as the user waits them (default); cpu: the process's CPU time, "
                             "which other jobs do not inflate (use with --threads 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--json", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    import ast

    from daf.bench.methods import workload_config
    from daf.config import Config
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads {args.threads}: expected a positive number of threads")
        import torch
        torch.set_num_threads(args.threads)
    config = Config() if args.default else workload_config(args.workload)
    if args.bits is not None:
        config = config.replace(bits=args.bits)
    if args.return_pages:
        config = config.replace(return_pages=True)
    if args.remakes is not None:
        from daf.config import parse_remakes
        try:
            config = config.replace(remakes=parse_remakes(args.remakes))
        except ValueError as error:
            raise SystemExit(f"--remakes {args.remakes}: {error}") from None
    result = measure(args.workload, args.batch, args.steps, args.warmup, options, config, clock=args.clock)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daf.bench overhead", allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args(argv))
