"""daf.bench.memory's pieces: the per-workload search with fake probes, ``run`` with a fake bench, and
real probe processes against a cap (tiny-mnist: seconds each)."""

import argparse
import json
import os
import statistics
import sys

import pytest

from daf import Config
from daf.bench import memory, probe
from daf.bench.memory import ProbeOutcome, bench_workload, run_probe_process
from daf.bench.methods import Method, methods_for

MIB = 1 << 20


class FakeProbes:
    """Stands in for ``run_probe_process``: fits up to a threshold per method; peak = 100 MiB + batch MiB."""

    def __init__(self, thresholds):
        self.thresholds, self.calls = thresholds, []

    def __call__(self, workload, method, batch, steps, cap, timeout, lock=None):
        self.calls.append((method.name, batch, steps, cap, timeout, lock))
        if batch > self.thresholds[method.name]:
            return ProbeOutcome(batch, False, None, [], "over the cap")
        return ProbeOutcome(batch, True, (100 + batch) * MIB, [0.5, 0.01 * batch, 0.02 * batch, 0.03 * batch][:steps], "")


def test_bench_workload_records_each_method(monkeypatch):
    methods = [Method("a", allocator="system"), Method("b"), Method("c", daf=Config(bits=2))]
    fake = FakeProbes({"a": 100, "b": 500, "c": 8})  # c does not fit at the start (16)
    monkeypatch.setattr(memory, "run_probe_process", fake)
    logged, partials = [], []
    bench = bench_workload("tiny-mnist", methods, cap=10**12, start=16, resolution=0.1, timeout=7.0,
                           lock="/tmp/x.lock", log=logged.append,
                           on_method=lambda partial: partials.append([r["method"]["name"] for r in partial["methods"]]))
    assert partials == [["a"], ["a", "b"], ["a", "b", "c"]]
    assert bench["workload"] == "tiny-mnist" and bench["start"] == 16 and bench["resolution"] == 0.1
    rows = {r["method"]["name"]: r for r in bench["methods"]}
    assert list(rows) == ["a", "b", "c"]
    assert rows["a"]["method"] == methods[0].to_dict()
    for name, threshold in (("a", 100), ("b", 500), ("c", 8)):
        row = rows[name]
        assert row["largest_batch"] <= threshold < row["failed_at"]
        assert row["failed_at"] - row["largest_batch"] <= max(1, int(row["largest_batch"] * 0.1))
        assert row["peak_rss_bytes"] == (100 + row["largest_batch"]) * MIB
        assert [p["batch"] for p in row["probes"]] == [c[1] for c in fake.calls if c[0] == name]
        assert all(p["fits"] == (p["batch"] <= threshold) for p in row["probes"])
    # the first probe, at the common batch, runs four steps; the median of the last three is its step time;
    # the others run three (DAF's process may settle only in its third step)
    first_a = [c for c in fake.calls if c[0] == "a"]
    assert first_a[0][1:3] == (16, 4) and all(c[2] == memory.PROBE_STEPS == 3 for c in first_a[1:])
    assert rows["a"]["at_start"] == {"step_ms": pytest.approx(1000 * statistics.median([0.16, 0.32, 0.48])),
                                     "peak_rss_bytes": 116 * MIB}
    assert rows["c"]["at_start"] is None  # did not fit at the common batch
    assert all(c[3:] == (10**12, 7.0, "/tmp/x.lock") for c in fake.calls)
    assert len(logged) == len(fake.calls) and all("tiny-mnist | " in line for line in logged)
    assert any("fits, peak 116 MiB" in line for line in logged) and any("no (over the cap)" in line for line in logged)


def _args(tmp_path, **overrides):
    values = {"workloads": "resnet18-fmnist,minilm-tweets,smollm-lora", "cap": "3GiB", "methods": None,
              "resolution": 0.1, "timeout": 900, "lock": None, "quick": False,
              "json": str(tmp_path / "out" / "m.json"), "png": None}
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture
def fake_bench(monkeypatch, tmp_path):
    """Stands in for ``bench_workload``; after each method it reads back the JSON that run() saved
    (at ``_args``'s default path)."""
    calls = []
    json_path = tmp_path / "out" / "m.json"

    def bench(workload, methods, cap, start, resolution, timeout, lock, log=print, on_method=None):
        call = {"workload": workload, "methods": [m.name for m in methods], "cap": cap, "start": start,
                "resolution": resolution, "timeout": timeout, "lock": lock, "saved": []}
        calls.append(call)
        rows = []
        partial = {"workload": workload, "start": start, "resolution": resolution, "methods": rows}
        for i, m in enumerate(methods):
            rows.append({"method": m.to_dict(), "largest_batch": 10 * (i + 1), "failed_at": 11 * (i + 1),
                         "peak_rss_bytes": 200 * MIB, "at_start": {"step_ms": 5.0 + i, "peak_rss_bytes": 150 * MIB},
                         "probes": []})
            if on_method is not None:
                on_method(partial)
                call["saved"].append(json.loads(json_path.read_text()) if json_path.exists() else None)
        return partial

    monkeypatch.setattr(memory, "bench_workload", bench)
    return calls


def test_run_quick_settings_and_json(tmp_path, fake_bench, capsys):
    assert memory.run(_args(tmp_path, quick=True, png=str(tmp_path / "p" / "m.png"))) == 0
    [call] = fake_bench
    # the JSON is written after every method, incomplete until the end (a stopped run keeps what it measured)
    assert [len(saved["workloads"][0]["methods"]) for saved in call["saved"]] == [1, 2, 3]
    assert all(saved["complete"] is False for saved in call["saved"])
    assert call["workload"] == "tiny-mnist" and call["cap"] == 600 * MIB and call["resolution"] == 0.25
    assert call["methods"] == [m.name for m in methods_for("tiny-mnist", 600 * MIB, quick=True)]
    record = json.loads((tmp_path / "out" / "m.json").read_text())
    assert record["schema"] == "daf.bench.memory/1" and record["cap_bytes"] == 600 * MIB
    assert record["complete"] is True and len(record["workloads"][0]["methods"]) == 3
    assert [w["workload"] for w in record["workloads"]] == ["tiny-mnist"]
    assert os.path.getsize(tmp_path / "p" / "m.png") > 1000
    out = capsys.readouterr().out
    assert "largest batch under 600 MiB" in out and "x fp32 (system)" in out
    assert f"figures: {tmp_path / 'out' / 'm.json'}" in out and "plot: " in out


def test_run_keeps_a_given_cap_and_filters_methods(tmp_path, fake_bench):
    assert memory.run(_args(tmp_path, quick=True, cap="1GiB", methods="fp32,DAF 2-bit,nonesuch",
                            resolution=0.5)) == 0
    [call] = fake_bench
    assert call["cap"] == 1 << 30 and call["resolution"] == 0.5
    assert call["methods"] == ["fp32", "DAF 2-bit"]


def test_run_every_workload_in_order(tmp_path, fake_bench):
    assert memory.run(_args(tmp_path, workloads="tiny-mnist,resnet18-fmnist", lock="/tmp/l", timeout=5)) == 0
    assert [c["workload"] for c in fake_bench] == ["tiny-mnist", "resnet18-fmnist"]
    # saved while the second workload ran: the first complete, the second as far as it got
    second = fake_bench[1]["saved"]
    assert second and [w["workload"] for w in second[0]["workloads"]] == ["tiny-mnist", "resnet18-fmnist"]
    assert len(second[0]["workloads"][0]["methods"]) == len(fake_bench[0]["methods"])
    assert len(second[0]["workloads"][1]["methods"]) == 1
    assert [c["start"] for c in fake_bench] == [128, 32]
    assert all(c["cap"] == 3 << 30 and c["lock"] == "/tmp/l" and c["timeout"] == 5 for c in fake_bench)
    assert len(fake_bench[1]["methods"]) == len(methods_for("resnet18-fmnist", 3 << 30))


def test_run_rejects_unknown_workloads(tmp_path, fake_bench):
    with pytest.raises(SystemExit, match=r"unknown workload\(s\) \['cifar'\]"):
        memory.run(_args(tmp_path, workloads="tiny-mnist,cifar"))
    assert fake_bench == []


def test_command_recorded_under_python_m_daf_bench(tmp_path, fake_bench, monkeypatch):
    from daf.bench.__main__ import main
    path = tmp_path / "m.json"
    argv = ["memory", "--quick", "--json", str(path)]
    monkeypatch.setattr(sys, "argv", [memory.__file__.replace("memory.py", "__main__.py"), *argv])
    assert main(argv) == 0
    assert json.loads(path.read_text())["command"] == f"daf bench memory --quick --json {path}"


def test_peak_rss_bytes_of_this_process():
    from daf.workloads.measure import peak_rss_bytes, rss_bytes
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    assert peak_rss_bytes() >= rss > 0 and rss_bytes() > 0 and rss_bytes(os.getpid()) > 0


# --- real probe processes ------------------------------------------------------------------------

FP32_SYSTEM = Method("fp32 (system malloc)", allocator="system")


def test_a_probe_over_the_cap_is_killed():
    outcome = run_probe_process("tiny-mnist", FP32_SYSTEM, 8, 2, cap=40 * MIB, timeout=60)
    assert outcome == ProbeOutcome(8, False, None, [], "over the cap")


def test_a_probe_past_its_timeout_is_killed():
    outcome = run_probe_process("tiny-mnist", FP32_SYSTEM, 8, 2, cap=1 << 40, timeout=0.3)
    assert not outcome.fits and outcome.reason.startswith("still running after")


def test_a_failing_probe_reports_its_error():
    outcome = run_probe_process("no-such-workload", FP32_SYSTEM, 8, 2, cap=1 << 40, timeout=60)
    assert not outcome.fits and outcome.peak_rss_bytes is None
    assert outcome.reason.startswith("exit 1: ") and "no-such-workload" in outcome.reason


def test_a_probe_that_fits(tmp_path):
    outcome = run_probe_process("tiny-mnist", Method("DAF 2-bit", daf=Config(bits=2)), 8, 2, cap=4 << 30, timeout=120,
                                lock=str(tmp_path / "lock"))
    assert outcome.fits and outcome.reason == "" and outcome.batch == 8
    assert 50 * MIB < outcome.peak_rss_bytes <= 4 << 30
    assert len(outcome.step_seconds) == 2 and all(s > 0 for s in outcome.step_seconds)
    assert (tmp_path / "lock").exists()
    assert outcome.to_dict() == {"batch": 8, "fits": True, "peak_rss_bytes": outcome.peak_rss_bytes,
                                 "step_seconds": outcome.step_seconds, "reason": ""}
