"""Running the arms of ``daf compare``, each in its own process so that its peak RSS is its own.

Each arm is ``python -m daf.cli train ... --result-file F``: the same workload, options, seed,
steps and batch; only the DAF settings differ. The child runs in its own session, so a Ctrl-C
at the terminal reaches only this process, which forwards one SIGINT per Ctrl-C: the child then
stops training, evaluates and writes what it measured.

The child never outlives this process: a SIGTERM here (``kill``, ``timeout``, a job scheduler) is passed
on to it, and on Linux the kernel sends it SIGTERM if this process dies any other way (SIGKILL
included: ``PR_SET_PDEATHSIG``). Its own session would otherwise keep it training, orphaned, for
as long as the arm takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["run_arm_subprocess", "read_result"]


def run_arm_subprocess(train_argv: list[str]) -> tuple[dict[str, Any] | None, bool, str | None]:
    """Run ``daf train`` with ``train_argv`` in a child process.

    Returns (the run record or None, whether Ctrl-C was pressed, an error message or None).
    """
    with tempfile.TemporaryDirectory(prefix="daf-arm-") as tmp:
        result = Path(tmp) / "run.json"
        command = [sys.executable, "-m", "daf.cli", "train", *train_argv, "--result-file", str(result)]
        process = subprocess.Popen(command, start_new_session=True, preexec_fn=_dies_with_parent())
        interrupts = 0
        with _terminate_passed_on(process):
            while True:
                try:
                    code = process.wait()
                    break
                except KeyboardInterrupt:
                    interrupts += 1
                    if interrupts >= 3:
                        process.kill()
                    else:
                        process.send_signal(signal.SIGINT)
        record, error = read_result(result, code)
        return record, interrupts > 0, error


def _dies_with_parent() -> Callable[[], None] | None:
    """For ``Popen(preexec_fn=...)``: the child gets SIGTERM when its parent dies (Linux ``prctl``);
    None where there is no such call."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    parent = os.getpid()

    def arm() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nobody would signal the child
            os._exit(1)
    return arm


@contextlib.contextmanager
def _terminate_passed_on(process: subprocess.Popen) -> Iterator[None]:
    """While the arm runs, a SIGTERM to this process terminates the arm (killed if it is not gone in 30 s);
    once it has exited, this process gets the signal again under the previous handler, as it would have.
    Only on the main thread, where handlers can be set, and never where the caller ignores SIGTERM.
    (The handler must not wait for the arm itself: the interrupted ``Popen.wait`` holds its lock.)"""
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous == signal.SIG_IGN:
        yield
        return
    received = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        received.set()
        process.terminate()
        timer = threading.Timer(30, process.kill)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


def read_result(path: Path, code: int) -> tuple[dict[str, Any] | None, str | None]:
    """What an arm left in its result file: (its run record, None), or (None, why it has none): the one
    line of an expected failure (``{"error": ...}``), or its exit status."""
    if not path.exists():
        return None, f"it exited with status {code} and wrote no result (its error is above)"
    data = json.loads(path.read_text())
    if "error" in data:
        return None, data["error"]
    return data, None
