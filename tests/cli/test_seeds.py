"""``daf seeds FILE...``: one summary over runs saved apart, and the runs it refuses to put together."""

import copy
import json

import pytest

import daf
from daf.cli import main
from daf.cli.record import envelope
from daf.cli.seeds import combine_records


@pytest.fixture
def pair(tiny_arms):
    return tiny_arms


def _at_seed(run: dict, seed: int, accuracy: float) -> dict:
    """The run as if trained at ``seed`` (its digests changed alike in both arms)."""
    run = copy.deepcopy(run)
    run["seed"], run["options"]["seed"] = seed, seed
    run["init_digest"], run["data_digest"] = f"init{seed}", f"data{seed}"
    run["eval"]["accuracy"] = accuracy
    return run


def _file(tmp_path, name: str, *runs: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(envelope("train", [], {r["arm"] + str(r["seed"]): r for r in runs}, False, [])))
    return str(path)


def test_runs_saved_apart_summarize_like_compare_seeds(tmp_path, pair, capsys):
    fp32, compressed = pair
    files = [_file(tmp_path, "s0.json", _at_seed(fp32, 0, 0.90), _at_seed(compressed, 0, 0.89)),
             _file(tmp_path, "s1-fp32.json", _at_seed(fp32, 1, 0.92)),
             _file(tmp_path, "s1-daf.json", _at_seed(compressed, 1, 0.92))]
    out = tmp_path / "summary.json"
    assert main(["seeds", *files, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["seeds"]
    assert summary["seeds"] == [0, 1] and summary["arms"]["fp32"]["mean"] == pytest.approx(91.0)
    assert summary["difference"]["values"] == {"0": pytest.approx(-1.0), "1": pytest.approx(0.0)}
    assert "DAF - fp32: -0.50 ± 0.71 points" in capsys.readouterr().out


def test_interrupted_runs_are_left_out_and_named(pair):
    fp32, compressed = pair
    stopped = _at_seed(compressed, 1, 0.5)
    stopped["interrupted"] = True
    by_seed, notes = combine_records([("a.json", {"schema": "daf.results/1", "runs": {
        "f0": _at_seed(fp32, 0, 0.9), "d0": _at_seed(compressed, 0, 0.9), "d1": stopped}})])
    assert list(by_seed) == [0] and notes == ["a.json: the daf run of seed 1 is left out (interrupted or not "
                                              "evaluated: 4/4 steps)"]


def _refusal(records) -> str:
    with pytest.raises(ValueError) as error:
        combine_records(records)
    return str(error.value)


def test_what_cannot_be_one_comparison_is_refused_naming_the_files(pair):
    fp32, compressed = pair
    wrap = lambda *runs: {"schema": "daf.results/1", "runs": {str(i): r for i, r in enumerate(runs)}}
    other_bits = _at_seed(compressed, 1, 0.9)
    other_bits["config"] = daf.Config(bits=4).to_dict()
    assert "b.json and a.json trained DAF differently (DAF 4-bit against DAF 2-bit)" in _refusal(
        [("a.json", wrap(_at_seed(compressed, 0, 0.9))), ("b.json", wrap(other_bits))])
    other_steps = _at_seed(fp32, 1, 0.9)
    other_steps["steps_requested"] = other_steps["steps_done"] = 3
    assert "differ in steps_requested (3 against 4)" in _refusal([("a.json", wrap(_at_seed(fp32, 0, 0.9))),
                                                                  ("b.json", wrap(other_steps))])
    assert "two fp32 runs of seed 0: a.json and b.json" in _refusal([("a.json", wrap(_at_seed(fp32, 0, 0.9))),
                                                                     ("b.json", wrap(_at_seed(fp32, 0, 0.8)))])
    mismatched = _at_seed(compressed, 0, 0.9)
    mismatched["init_digest"] = "other"
    assert "seed 0: the fp32 run (a.json) and the DAF run (b.json) did not start from the same weights" in _refusal(
        [("a.json", wrap(_at_seed(fp32, 0, 0.9))), ("b.json", wrap(mismatched))])
    assert "not a daf results file" in _refusal([("x.json", {"runs": {}})])
    # where tensors come from, which kernels run and the rounding seed are not the method: those runs combine
    elsewhere = _at_seed(compressed, 1, 0.9)
    elsewhere["config"] = daf.Config(bits=2, allocator="system", decommit=True, backend="reference", channels_last=False,
                                     seed=5).to_dict()
    assert list(combine_records([("a.json", wrap(_at_seed(compressed, 0, 0.9))), ("b.json", wrap(elsewhere))])[0]) == [0, 1]


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert main(["seeds", str(tmp_path / "nope.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("daf: error: daf seeds:") and "nope.json" in err and "Traceback" not in err
