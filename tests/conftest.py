"""Fixtures shared by test folders."""

import pytest

TINY = {"train_size": 256, "eval_size": 100}


@pytest.fixture(scope="session")
def tiny_arms():
    """An fp32 and a DAF 2-bit run record of tiny-mnist, 4 steps of 32 (the training loop's output)."""
    import daf
    from daf.workloads.train import RunSettings, run_training
    fp32 = run_training(RunSettings("tiny-mnist", dict(TINY), steps=4, batch=32, progress=False))
    compressed = run_training(RunSettings("tiny-mnist", dict(TINY), steps=4, batch=32, daf=daf.Config(bits=2),
                                          progress=False))
    return fp32, compressed
