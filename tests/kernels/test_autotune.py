"""The strategy autotuner: times once, reuses its cache file, survives a corrupt one."""

import json
import warnings

import pytest
import torch

from daf.kernels.autotune import CACHE_ENV, Autotuner, default_cache_path, machine_signature
from daf.kernels.backend import NativeBackend


class FakeClock:
    """A clock that advances by the cost of the candidate that just ran."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def timed_runner(clock, costs, calls):
    def run(name):
        calls.append(name)
        clock.now += costs[name]
    return run


def test_fastest_candidate_wins_and_is_reused_from_disk(tmp_path):
    path = tmp_path / "tune.json"
    clock, calls = FakeClock(), []
    tuner = Autotuner(path, repeats=2, clock=clock)
    run = timed_runner(clock, {"a": 3.0, "b": 1.0}, calls)
    assert tuner.choose("class-1", ("a", "b"), run) == "b"
    assert calls == ["a", "a", "b", "b"] and tuner.timed == 1
    assert tuner.choose("class-1", ("a", "b"), run) == "b" and len(calls) == 4  # in memory
    second = Autotuner(path, clock=clock)  # a new process: decisions come from the file
    assert second.choose("class-1", ("a", "b"), run) == "b" and len(calls) == 4 and second.timed == 0
    saved = json.loads(path.read_text())
    assert saved["decisions"][f"{machine_signature()}|class-1"]["seconds"] == {"a": 3.0, "b": 1.0}


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text("{not json")
    clock, calls = FakeClock(), []
    tuner = Autotuner(path, repeats=1, clock=clock)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        choice = tuner.choose("c", ("a", "b"), timed_runner(clock, {"a": 1.0, "b": 2.0}, calls))
    assert choice == "a" and calls == ["a", "b"]
    assert json.loads(path.read_text())["version"] == 1  # replaced by a good file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Autotuner(path).choose("c", ("a", "b"), lambda name: pytest.fail("should not time")) == "a"


@pytest.mark.parametrize("content", ['{"version": 99, "decisions": {}}', '[1, 2]', '{"version": 1, "decisions": {"k": 3}}'])
def test_wrong_structure_counts_as_corrupt(tmp_path, content):
    path = tmp_path / "tune.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert Autotuner(path).decisions() == {}


def test_unwritable_cache_warns_once_and_keeps_decisions_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    clock = FakeClock()
    tuner = Autotuner(blocker / "sub" / "tune.json", repeats=1, clock=clock)  # parent is a file
    with pytest.warns(RuntimeWarning, match="not written"):
        tuner.choose("c1", ("a",), timed_runner(clock, {"a": 1.0}, []))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuner.choose("c2", ("a",), timed_runner(clock, {"a": 1.0}, []))
    assert len(tuner.decisions()) == 2


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert default_cache_path() == tmp_path / "kernels-autotune.json"
    assert Autotuner().path == tmp_path / "kernels-autotune.json"
    with pytest.raises(ValueError, match="repeats"):
        Autotuner(repeats=0)


def test_backend_tunes_once_per_shape_class_and_reuses_the_file(extension, tmp_path):
    path = tmp_path / "tune.json"
    first = NativeBackend(Autotuner(path, repeats=1))
    x = torch.randn(1 << 16)  # two groups of 32768: few groups, where the strategies compete
    first.encode_flat(x, 2, 1 << 15, True, 0)
    first.encode_flat(x + 1, 2, 1 << 15, True, 1)  # same class
    first.encode_flat(x.to(torch.bfloat16), 2, 1 << 15, True, 0)  # another class
    first.encode_flat(x, 2, 256, True, 0)  # 256 groups: whole groups without timing
    assert first.tuner.timed == 2
    second = NativeBackend(Autotuner(path, repeats=1))
    second.encode_flat(x, 2, 1 << 15, True, 0)
    second.encode_flat(x.to(torch.bfloat16), 2, 1 << 15, True, 0)
    assert second.tuner.timed == 0
    choices = {d["choice"] for d in second.tuner.decisions().values()}
    assert choices <= {"whole_groups", "split_range"}
