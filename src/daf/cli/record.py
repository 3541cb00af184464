"""The results record that ``--json`` writes: the command, the date, the machine and each arm's run."""

from __future__ import annotations

import json
import os
import platform
import shlex
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["SCHEMA", "machine", "envelope", "write_json", "RUN_KEYS"]

SCHEMA = "daf.results/1"
# The keys every run in ``runs`` has (tests check them; docs/results.md describes them).
RUN_KEYS = ("arm", "workload", "options", "config", "seed", "steps_requested", "steps_done", "batch", "metric",
            "higher_is_better", "eval", "losses", "step_seconds", "median_step_seconds", "activations",
            "peak_rss_bytes", "start_rss_bytes", "timeline", "data_digest", "init_digest", "interrupted",
            "train_seconds", "wall_seconds")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import daf
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "daf": daf.__version__}


def envelope(kind: str, argv: list[str], runs: dict[str, dict[str, Any]], interrupted: bool,
             plots: list[str]) -> dict[str, Any]:
    """The top level of the JSON file: ``schema``, ``kind`` ("train" or "compare"), ``command``, ``date``,
    ``machine``, ``runs`` (by arm: "fp32", "daf"), ``interrupted`` and ``plots`` (PNG paths)."""
    return {"schema": SCHEMA, "kind": kind, "command": "daf " + shlex.join(argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(), "runs": runs,
            "interrupted": interrupted, "plots": plots}


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
