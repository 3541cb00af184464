"""Running the arms of ``daf compare``, each in its own process so that its peak RSS is its own.

Each arm is ``python -m daf.cli train ... --result-file F``: the same workload, options, seed,
steps and batch; only the DAF settings differ. The child runs in its own session, so a Ctrl-C
at the terminal reaches only this process, which forwards one SIGINT per Ctrl-C: the child then
stops training, evaluates and writes what it measured.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
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
        process = subprocess.Popen(command, start_new_session=True)
        interrupts = 0
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


def read_result(path: Path, code: int) -> tuple[dict[str, Any] | None, str | None]:
    """What an arm left in its result file: (its run record, None), or (None, why it has none): the one
    line of an expected failure (``{"error": ...}``), or its exit status."""
    if not path.exists():
        return None, f"it exited with status {code} and wrote no result (its error is above)"
    data = json.loads(path.read_text())
    if "error" in data:
        return None, data["error"]
    return data, None
