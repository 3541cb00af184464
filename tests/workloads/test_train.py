"""The training loop: its record, both arms on the same data, Ctrl-C (in process)."""

import signal

import pytest

import daf
from daf.cli.record import RUN_KEYS
from daf.workloads.train import RunSettings, run_training

TINY = {"train_size": 256, "eval_size": 100}


@pytest.fixture
def arms(tiny_arms):
    return tiny_arms


def test_record_fields(arms):
    for run in arms:
        assert set(RUN_KEYS) <= set(run)
        assert run["steps_done"] == 4 and len(run["losses"]) == 4 and len(run["step_seconds"]) == 4
        assert run["eval"]["eval_examples"] == 100 and run["median_step_seconds"] > 0
        assert run["peak_rss_bytes"] > 0 and not run["interrupted"]
        phases = {event[1] for event in run["timeline"]["events"]}
        assert {"forward", "forward end", "backward", "backward end"} <= phases


def test_same_weights_and_batches_in_both_arms(arms):
    fp32, compressed = arms
    assert fp32["init_digest"] == compressed["init_digest"]
    assert fp32["data_digest"] == compressed["data_digest"]
    assert fp32["config"] is None and compressed["config"]["bits"] == 2
    assert daf.Config.from_dict(compressed["config"]) == daf.Config(bits=2)  # the allocator was "auto" already


def test_activation_bytes(arms):
    fp32, compressed = arms
    assert fp32["activations"]["raw_bytes"] == fp32["activations"]["stored_bytes"] > 0
    raw, stored = compressed["activations"]["raw_bytes"], compressed["activations"]["stored_bytes"]
    assert stored < raw
    assert abs(raw - fp32["activations"]["raw_bytes"]) < 0.01 * raw  # both count what autograd saves


def test_interrupt_keeps_what_was_measured(monkeypatch):
    from daf.workloads.tiny_mnist import TinyMNIST
    calls = {"n": 0}
    original = TinyMNIST.loss

    def loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, model, batch)

    monkeypatch.setattr(TinyMNIST, "loss", loss)
    run = run_training(RunSettings("tiny-mnist", dict(TINY), steps=50, batch=16, progress=False))
    assert run["interrupted"] and run["steps_done"] == 2 and run["eval"] is not None


class _CtrlCWhenCollected:
    """Presses Ctrl-C from inside ``__del__``, where a KeyboardInterrupt is printed and lost."""

    def __init__(self, times: int) -> None:
        self.times = times

    def __del__(self) -> None:
        for _ in range(self.times):
            signal.raise_signal(signal.SIGINT)


def _train_pressing_ctrl_c(monkeypatch, times: int, inside_del: bool) -> dict:
    from daf.workloads.tiny_mnist import TinyMNIST
    calls = {"n": 0}
    original = TinyMNIST.loss

    def loss(self, model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            if inside_del:
                _CtrlCWhenCollected(times)  # dropped at once: its __del__ runs here
            else:
                for _ in range(times):
                    signal.raise_signal(signal.SIGINT)
        return original(self, model, batch)

    monkeypatch.setattr(TinyMNIST, "loss", loss)
    # Python's own SIGINT handler, whether or not the runner was started with SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run_training(RunSettings("tiny-mnist", dict(TINY), steps=50, batch=16, progress=False))
    finally:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("inside_del", [False, True])
def test_ctrl_c_stops_at_the_end_of_the_step_even_inside_a_finalizer(monkeypatch, inside_del):
    run = _train_pressing_ctrl_c(monkeypatch, times=1, inside_del=inside_del)
    assert run["interrupted"] and run["steps_done"] == 3 and run["eval"] is not None


def test_a_second_ctrl_c_interrupts_the_step_at_once(monkeypatch):
    run = _train_pressing_ctrl_c(monkeypatch, times=2, inside_del=False)
    assert run["interrupted"] and run["steps_done"] == 2 and run["eval"] is not None


def test_ctrl_c_ignored_by_the_caller_stays_ignored(monkeypatch):
    from daf.workloads.interrupt import StopRequest
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest() as stop:
            signal.raise_signal(signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert not stop.requested and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_last_steps_bytes_and_plan_are_recorded_for_daf_arms():
    adaptive = daf.Config(policy=daf.Adaptive(average=4.0, replan_every=2, window=1))
    run = run_training(RunSettings("tiny-mnist", dict(TINY), steps=5, batch=32, daf=adaptive, progress=False))
    last, traced = run["activations_last_step"], run["activations"]
    assert last["raw_bytes"] == traced["raw_bytes"] > 0 and last["policy"]["policy"] == "adaptive"
    assert last["policy"]["plans"] >= 1 and last["policy"]["plan"]  # planned after the traced step (2)
    assert 4.0 <= traced["mean_code_bits"] <= 8  # uniform 4 before the first plan (the rules raise some saves)
    assert 1 <= last["mean_code_bits"] <= 8
    fp32 = run_training(RunSettings("tiny-mnist", dict(TINY), steps=1, batch=32, progress=False))
    assert fp32["activations_last_step"] is None
