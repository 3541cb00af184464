"""``daf bench memory --quick`` end to end (about 70 s): real probe processes on tiny-mnist, under a 460 MiB cap
and a coarse search so that each method takes three or four probes (the default --quick cap, 600 MiB, takes
six: 95 s)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import descendants

TIMEOUT = 400


def _stop(process):
    """Ctrl-C first (the bench then kills its running probe itself), then SIGKILL for all that is left."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGSTOP)  # no new probe while the tree is listed
    for pid in [*descendants(process.pid), process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bench reads /proc")
def test_bench_memory_quick(tmp_path):
    json_path, png_path = tmp_path / "m.json", tmp_path / "m.png"
    command = [sys.executable, "-m", "daf.cli", "bench", "memory", "--quick", "--json", str(json_path),
               "--png", str(png_path), "--cap", "460MiB", "--resolution", "0.5"]
    # SIGINT back to its default in the child: a runner started as a background job inherits it ignored.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:  # timed out or interrupted: never leave the bench or a probe behind
            _stop(process)
    assert process.returncode == 0, err[-3000:]

    record = json.loads(json_path.read_text())
    assert record["schema"] == "daf.bench.memory/1" and record["complete"] is True
    cap = record["cap_bytes"]
    assert cap == 460 << 20
    assert record["command"].startswith("daf bench memory --quick")
    [bench] = record["workloads"]
    assert bench["workload"] == "tiny-mnist"
    names = [row["method"]["name"] for row in bench["methods"]]
    assert names == ["fp32 (system malloc)", "fp32", "DAF 2-bit"]
    for row in bench["methods"]:
        name = row["method"]["name"]
        assert row["largest_batch"] > 0, name
        assert row["probes"], name
        for probe in row["probes"]:
            if probe["fits"]:
                assert 0 < probe["peak_rss_bytes"] <= cap, (name, probe)
                assert probe["step_seconds"] and probe["reason"] == ""
            else:
                assert probe["reason"], (name, probe)
        fitting = [p["batch"] for p in row["probes"] if p["fits"]]
        assert row["largest_batch"] == max(fitting)
        if row["failed_at"] is not None:
            assert row["failed_at"] > row["largest_batch"]
            assert row["failed_at"] == min(p["batch"] for p in row["probes"] if not p["fits"])
        assert row["peak_rss_bytes"] <= cap
    assert png_path.exists() and png_path.stat().st_size > 1000

    assert "tiny-mnist: largest batch under 460 MiB of peak RSS" in out
    for column in ("method", "largest batch", "x fp32 (system)", "x fp32", "peak RSS MiB"):
        assert column in out
    table_rows = [line for line in out.splitlines() if line.startswith(("fp32", "DAF 2-bit"))]
    assert [line.split("  ")[0].strip() for line in table_rows] == names
    for line, row in zip(table_rows, bench["methods"]):
        assert str(row["largest_batch"]) in line.split()
    assert f"figures: {json_path}" in out and f"plot: {png_path}" in out
