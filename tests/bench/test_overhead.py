"""``python -m daf.bench overhead``: every component has a row, and together they explain the gap."""

import json
import math

from daf.bench import overhead
from daf.bench.__main__ import main


def test_overhead_table_and_json(tmp_path, capsys):
    path = tmp_path / "o.json"
    assert main(["overhead", "--workload", "tiny-mnist", "--batch", "32", "--steps", "2", "--warmup", "1",
                 "-O", "train_size=256", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    components = result["components"]
    for name in ("fp32 step", "DAF step", "encode[codes]", "encode[relu_mask]", "decode[Packed]", "store",
                 "policy", "pack: routing and bookkeeping", "op tracking", "unexplained"):
        assert name in components and math.isfinite(components[name])
    parts = sum(v for k, v in components.items() if k not in ("fp32 step", "DAF step"))
    assert math.isclose(components["fp32 step"] + parts, components["DAF step"], rel_tol=1e-9)
    assert len(result["rows"]) == 2
    assert result["config"]["bits"] == 2  # the workload's own (daf.bench.methods.workload_config)
    assert "encode[relu_mask]" in capsys.readouterr().out
    assert math.isclose(result["step_ratio"], overhead.step_ratio(result["rows"]))


def test_default_measures_daf_wraps_own_config(tmp_path, capsys):
    """``--default``: ``Config()`` (the automatic choice per save), not the workload's uniform 2 bits."""
    path = tmp_path / "o.json"
    assert main(["overhead", "--workload", "tiny-mnist", "--batch", "32", "--steps", "1", "--warmup", "1",
                 "-O", "train_size=256", "--default", "--json", str(path)]) == 0
    config = json.loads(path.read_text())["config"]
    assert config["bits"] is None and config["policy"]["kind"] == "auto"
    assert "DAF auto" in capsys.readouterr().out


def test_the_arms_take_turns_going_first(monkeypatch):
    """DAF must not always run after the same arm: rounds alternate fp32 first and DAF first."""
    import daf
    import daf.tracing

    ran, tracking = [], []
    timed = overhead.timed_step

    class Tracker(daf.tracing.OpTracker):  # says when the tracker arm runs
        def __enter__(self):
            tracking.append(True)
            return super().__enter__()

        def __exit__(self, *exc):
            tracking.pop()
            return super().__exit__(*exc)

    def recording(workload, model, optimizer, batch, now):
        try:
            daf.session_of(model)
            ran.append("daf")
        except ValueError:
            ran.append("tracker" if tracking else "fp32")
        return timed(workload, model, optimizer, batch, now)

    monkeypatch.setattr(daf.tracing, "OpTracker", Tracker)
    monkeypatch.setattr(overhead, "timed_step", recording)
    overhead.measure("tiny-mnist", 16, steps=3, warmup=1, options={"train_size": 128})
    rounds = [tuple(ran[i:i + 3]) for i in range(0, len(ran), 3)]
    assert rounds == [("fp32", "tracker", "daf"), ("daf", "tracker", "fp32")] * 2


def test_step_ratio_is_the_median_of_each_rounds_ratio():
    rows = [{"fp32": 1.0, "daf": 1.1}, {"fp32": 4.0, "daf": 4.0}, {"fp32": 2.0, "daf": 2.6}]
    # the medians of the arms (2.0 and 2.6) would say 1.3; round by round the ratios are 1.1, 1.0, 1.3
    assert math.isclose(overhead.step_ratio(rows), 1.1)


def test_cpu_clock_is_recorded_and_explains_the_gap(tmp_path):
    path = tmp_path / "o.json"
    assert main(["overhead", "--workload", "tiny-mnist", "--batch", "32", "--steps", "2", "--warmup", "1",
                 "-O", "train_size=256", "--clock", "cpu", "--bits", "4", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["clock"] == "cpu" and result["threads"] >= 1 and result["config"]["bits"] == 4
    components = result["components"]
    parts = sum(v for k, v in components.items() if k not in ("fp32 step", "DAF step"))
    assert math.isclose(components["fp32 step"] + parts, components["DAF step"], rel_tol=1e-9)
    assert all(row["fp32"] > 0 and row["daf"] > 0 for row in result["rows"])


def test_an_unknown_clock_is_refused_by_name():
    import pytest
    with pytest.raises(ValueError, match="clock 'gpu': expected one of wall, cpu"):
        overhead.measure("tiny-mnist", 8, steps=1, warmup=0, options={"train_size": 64}, clock="gpu")


def test_a_thread_count_below_one_is_refused():
    import pytest
    with pytest.raises(SystemExit, match="--threads 0"):
        main(["overhead", "--workload", "tiny-mnist", "--threads", "0"])


def test_the_audit_is_averaged_over_the_steps_not_a_median():
    rows = [{"fp32": 1.0, "tracker": 1.0, "daf": 1.5, "audit": 0.3, "inner:audit": 0.01},
            {"fp32": 1.0, "tracker": 1.0, "daf": 1.0}, {"fp32": 1.0, "tracker": 1.0, "daf": 1.0}]
    components = overhead._components(rows)
    assert math.isclose(components["audit"], 0.1) and "inner:audit" not in components


def test_remakes_sets_the_rules_in_use_and_a_bad_name_is_refused(tmp_path):
    import pytest
    path = tmp_path / "o.json"
    assert main(["overhead", "--workload", "tiny-mnist", "--batch", "16", "--steps", "1", "--warmup", "0",
                 "-O", "train_size=64", "--default", "--remakes", "norm_block", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["config"]["remakes"] == ["norm_block"]
    with pytest.raises(SystemExit, match="--remakes head: Config.remakes: no remake rule named 'head'"):
        main(["overhead", "--workload", "tiny-mnist", "--remakes", "head"])
