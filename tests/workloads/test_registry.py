"""The workload registry and the fixed, seeded batch order (no data beyond tiny-mnist is loaded here)."""

import pytest
import torch

from daf.workloads import get_workload, names, workload_class
from daf.workloads.base import Workload, index_stream


def test_names_and_classes():
    assert names() == ("resnet18-fmnist", "minilm-tweets", "smollm-lora", "tiny-mnist")
    for name in names():
        cls = workload_class(name)
        assert issubclass(cls, Workload) and cls.name == name
        assert cls.metric in ("accuracy", "eval_loss")
        assert cls.default_steps > 0 and cls.default_batch > 0


def test_unknown_name_lists_the_allowed():
    with pytest.raises(ValueError, match="unknown workload 'cifar'.*resnet18-fmnist"):
        get_workload("cifar")


@pytest.mark.parametrize("name, options, message", [
    ("resnet18-fmnist", {"depth": 50}, "allowed options: seed, train_size, eval_size, width, max_lr"),
    ("resnet18-fmnist", {"width": 0}, "width must be a positive integer"),
    ("minilm-tweets", {"lr": -1.0}, "lr must be a positive number"),
    ("smollm-lora", {"seq_len": "long"}, "seq_len must be a positive integer"),
    ("tiny-mnist", {"seed": -1}, "seed must be a non-negative integer"),
    ("tiny-mnist", {"train_size": 0}, "train_size must be a positive integer or None"),
])
def test_bad_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        get_workload(name, **options)


def test_index_stream_is_fixed_by_seed_and_covers_each_epoch():
    first = torch.cat(list(index_stream(10, 4, 5, seed=3)))
    again = torch.cat(list(index_stream(10, 4, 5, seed=3)))
    other = torch.cat(list(index_stream(10, 4, 5, seed=4)))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert sorted(first[:10].tolist()) == list(range(10))  # the first epoch is a permutation
    assert sorted(first[10:20].tolist()) == list(range(10))


def test_options_round_trip():
    workload = get_workload("resnet18-fmnist", seed=2, width=8, train_size=16)
    assert workload.options() == {"seed": 2, "train_size": 16, "eval_size": None, "width": 8, "max_lr": 0.1}
    assert "width=8" in repr(workload)


def test_import_stays_lean():
    import subprocess
    import sys
    code = ("import sys, daf.workloads, daf.cli; "
            "print([m for m in ('transformers', 'peft', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
