"""Choose a kernel strategy by timing the candidates on this machine, and remember the choice.

The DAF paper picks its reduction strategy by offline profiling and names run-time choice
as an open question. Here the first tensor of each *shape class* (dtype, bits, rounding,
group size, and the order of magnitude of the element count) is encoded with every
candidate; the fastest wins and is written to a small JSON file, so that the next process
on the same machine skips the timing. Decisions are keyed by a machine signature (ISA,
architecture, thread count) so a cache copied elsewhere is not trusted blindly.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["Autotuner", "default_cache_path", "machine_signature", "CACHE_ENV"]

CACHE_ENV = "DAF_CACHE_DIR"
CACHE_FILE = "kernels-autotune.json"
CACHE_VERSION = 1


def default_cache_path() -> Path:
    """``$DAF_CACHE_DIR/kernels-autotune.json``, else under ``$XDG_CACHE_HOME/daf`` or ``~/.cache/daf``."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "daf")
    return Path(root) / CACHE_FILE


def machine_signature() -> str:
    """What a timing decision depends on besides the shape: e.g. ``x86_64-AVX512-2t``."""
    return f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}-{torch.get_num_threads()}t"


class Autotuner:
    """Per shape class, the fastest of a few candidates, timed once and cached on disk.

    ``choose(shape_class, candidates, run)`` returns the cached decision, or calls
    ``run(candidate)`` ``repeats`` times per candidate, keeps the one with the smallest
    best time, and saves it. A corrupt or unreadable cache file is ignored with a warning.
    """

    def __init__(self, path: Path | str | None = None, repeats: int = 3,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.path = Path(path) if path is not None else default_cache_path()
        self.repeats = repeats
        self.clock = clock
        self.signature = machine_signature()
        self.timed = 0  # shape classes timed by this object (the rest came from the cache)
        self._decisions: dict[str, dict] | None = None  # read lazily: most sessions never encode
        self._lock = threading.Lock()  # a background packer may encode beside the main thread
        self._warned_write = False

    def choose(self, shape_class: str, candidates: Sequence[str], run: Callable[[str], object]) -> str:
        """The candidate to use for ``shape_class``; times them all on a cache miss."""
        key = f"{self.signature}|{shape_class}"
        with self._lock:
            decisions = self._load()
            known = decisions.get(key)
            if known is not None and known.get("choice") in candidates:
                return known["choice"]
            seconds = {name: self._best_time(run, name) for name in candidates}
            choice = min(seconds, key=seconds.get)
            decisions[key] = {"choice": choice, "seconds": seconds}
            self.timed += 1
            self._save()
            return choice

    def decisions(self) -> dict[str, dict]:
        """A copy of what is known: ``{key: {"choice": name, "seconds": {name: s}}}``."""
        with self._lock:
            return dict(self._load())

    def _best_time(self, run: Callable[[str], object], name: str) -> float:
        best = float("inf")
        for _ in range(self.repeats):
            start = self.clock()
            run(name)
            best = min(best, self.clock() - start)
        return best

    def _load(self) -> dict[str, dict]:
        if self._decisions is None:
            self._decisions = self._read()
        return self._decisions

    def _read(self) -> dict[str, dict]:
        try:
            text = self.path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as error:
            warnings.warn(f"DAF autotune cache {self.path} unreadable ({error}); timing again", RuntimeWarning)
            return {}
        try:
            data = json.loads(text)
            if data.get("version") != CACHE_VERSION or not isinstance(data.get("decisions"), dict):
                raise ValueError("unexpected structure or version")
            decisions = data["decisions"]
            if not all(isinstance(v, dict) and isinstance(v.get("choice"), str) for v in decisions.values()):
                raise ValueError("a decision without a choice")
        except (ValueError, AttributeError) as error:  # json.JSONDecodeError is a ValueError
            warnings.warn(f"DAF autotune cache {self.path} is corrupt ({error}); ignoring it and timing again",
                          RuntimeWarning)
            return {}
        return decisions

    def _save(self) -> None:
        """Write atomically (temporary file + rename) so a reader never sees half a file."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, prefix=".autotune-", suffix=".tmp",
                                             delete=False) as f:
                json.dump({"version": CACHE_VERSION, "decisions": self._decisions}, f, indent=1, sort_keys=True)
            os.replace(f.name, self.path)
        except OSError as error:  # a read-only home must not break training: keep the decision in memory
            if not self._warned_write:
                self._warned_write = True
                warnings.warn(f"DAF autotune cache {self.path} not written ({error}); decisions kept in memory",
                              RuntimeWarning)
