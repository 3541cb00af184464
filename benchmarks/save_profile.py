"""Where DAF's time goes inside a step, per save kind and per function: ``daf.wrap(model)``'s default.

``daf bench overhead`` splits a step into codecs, store, policy and hooks; this script goes one level
down. It wraps a model (a workload's, or a Hugging Face architecture of ``transformer_archs.py`` at
random init) with ``Config()`` (or ``--config``), trains ``--warmup`` steps, then runs ``--steps`` more
under ``cProfile`` with timers around the session's codecs that file each encode by the record it
produced (``Packed`` = plain format-1 codes, ``ChannelPacked`` = the outlier split, ``DerivativePacked``
= GELU/SiLU derivative codes, ``MaskPacked`` ...) and the op that saved it, and each decode by its
record type. The timers are installed by this script on one session (a proxy around ``session.codecs``,
as ``daf bench overhead`` does): nothing in DAF's hot path knows of them.

    python benchmarks/save_profile.py --workload minilm-tweets --batch 32
    python benchmarks/save_profile.py --arch llama --steps 3
    python benchmarks/save_profile.py --workload smollm-lora --batch 8 --json docs/results/save_profile_smollm.json

Per kind: calls, total ms per step and elements; then the ``--top`` DAF functions by own time
(cProfile's tottime) and by cumulative time. CPU time of this process (``--clock cpu``) at ``--threads 1``
is what to read on a loaded machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import daf

sys.path.insert(0, str(Path(__file__).parent))


class _Proxy:
    def __init__(self, target: Any, methods: dict[str, Any]) -> None:
        self._target, self._methods = target, methods

    def __getattr__(self, name: str) -> Any:
        return self._methods.get(name) or getattr(self._target, name)


class KindTimers:
    """Seconds, calls and elements per (direction, record type, op) across the profiled steps."""

    def __init__(self, now: Any) -> None:
        self.now = now
        self.rows: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0, 0])
        self.active = False

    def add(self, key: tuple[str, str, str], seconds: float, numel: int) -> None:
        if self.active:
            row = self.rows[key]
            row[0] += seconds
            row[1] += 1
            row[2] += numel

    def install(self, session: Any) -> None:
        codecs = session.codecs

        def encode(name: str, x: torch.Tensor, spec: Any) -> Any:
            start = self.now()
            packed = codecs.encode(name, x, spec)
            self.add(("encode", f"{name}:{type(packed).__name__}", str(spec.consumer)), self.now() - start, x.numel())
            return packed

        def decode(packed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            start = self.now()
            out = codecs.decode(packed, *args, **kwargs)
            self.add(("decode", type(packed).__name__, ""), self.now() - start, out.numel())
            return out

        session.codecs = _Proxy(codecs, {"encode": encode, "decode": decode})


def _model_and_steps(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The model and a function running one training step on it."""
    if args.workload:
        from daf.workloads import get_workload
        workload = get_workload(args.workload)
        model = workload.build_model()
        batches = list(workload.batches(args.batch or workload.default_batch, args.warmup + args.steps))
        optimizer = workload.optimizer(model, args.warmup + args.steps)[0]

        def step(index: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            workload.loss(model, batches[index]).backward()
            optimizer.step()
        return model, step
    from transformer_archs import archs
    arch = archs("sdpa")[args.arch]
    model = arch.make()
    batch = arch.batch(torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(index: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        arch.loss(model, batch).backward()
        optimizer.step()
    return model, step


def profile(args: argparse.Namespace) -> dict[str, Any]:
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    model, step = _model_and_steps(args)
    config = daf.Config(**json.loads(args.config)) if args.config else daf.Config()
    daf.wrap(model, config)
    timers = KindTimers(now)
    timers.install(daf.session_of(model))
    for index in range(args.warmup):
        step(index)
    timers.active = True
    profiler = cProfile.Profile(now)
    start = now()
    profiler.enable()
    for index in range(args.warmup, args.warmup + args.steps):
        step(index)
    profiler.disable()
    seconds = (now() - start) / args.steps
    kinds = {" ".join(k for k in key if k): {"ms_per_step": 1000 * row[0] / args.steps, "calls": row[1] // args.steps,
                                            "elements": row[2] // args.steps}
             for key, row in sorted(timers.rows.items(), key=lambda item: -item[1][0])}
    return {"target": args.workload or args.arch, "batch": args.batch, "steps": args.steps, "clock": args.clock,
            "threads": torch.get_num_threads(), "step_ms": 1000 * seconds, "kinds": kinds,
            "functions": _functions(profiler, args.steps, args.top)}


def _functions(profiler: cProfile.Profile, steps: int, top: int) -> dict[str, list]:
    """The ``top`` functions of DAF (and torch ops called from it, by name) by own and cumulative time."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = f"{Path(path).name}:{line}({name})" if "daf" in path or path == "~" else None
        if where:
            rows.append((where, calls // steps, 1000 * own / steps, 1000 * cumulative / steps))
    by_own = sorted(rows, key=lambda r: -r[2])[:top]
    daf_only = [r for r in rows if not r[0].startswith("~")]
    by_cumulative = sorted(daf_only, key=lambda r: -r[3])[:top]
    return {"own": by_own, "cumulative": by_cumulative}


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['target']}: {result['step_ms']:.0f} ms per profiled step ({result['clock']} clock, "
             f"{result['threads']} threads; cProfile inflates Python-heavy parts)",
             f"{'save kind (codec:record op)':48s} {'ms/step':>9s} {'calls':>6s} {'Melem':>7s}"]
    for name, row in result["kinds"].items():
        lines.append(f"{name:48s} {row['ms_per_step']:9.1f} {row['calls']:6d} {row['elements'] / 1e6:7.2f}")
    for title, key, column in (("own time", "own", 2), ("cumulative", "cumulative", 3)):
        lines.append(f"\nby {title}: {'function':60s} {'calls':>6s} {'ms/step':>9s}")
        for row in result["functions"][key]:
            lines.append(f"  {row[0][:72]:72s} {row[1]:6d} {row[column]:9.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--workload")
    target.add_argument("--arch", help="a name of transformer_archs.archs: gpt2, bert, t5, llama, vit, convnext")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--config", default=None, help='daf.Config keywords as JSON, e.g. \'{"bits": 4}\'')
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = profile(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
