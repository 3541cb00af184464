import copy
import dataclasses
import json
import os
import pickle
import re

import pytest

from daf import Config
from daf.config import parse_size


def test_defaults_are_valid():
    c = Config()
    assert (c.bits, c.group_size, c.rounding, c.policy) == (2, 256, "stochastic", "uniform")


@pytest.mark.parametrize("field, value, allowed", [
    ("bits", 3, "one of (1, 2, 4, 8)"),
    ("bits", "2", "must be a number"),
    ("group_size", 100, "power of two"),
    ("group_size", 8, "in [16, 1048576]"),
    ("rounding", "up", "'stochastic', 'nearest'"),
    ("min_numel", -1, ">= 0"),
    ("seed", 1.5, "integer"),
    ("policy", "greedy", "'uniform', 'adaptive'"),
    ("codec", "zip", "'minmax', 'division'"),
    ("backend", "cuda", "'auto', 'native', 'reference'"),
    ("budget", "lots", "could not parse"),
    ("budget", -5, "positive"),
    ("min_bits", 3, "one of (1, 2, 4, 8)"),
    ("page_size", 5000, "power of two"),
    ("background", "yes", "True or False"),
])
def test_bad_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        Config(**{field: value})
    message = str(info.value)
    assert f"Config.{field}" in message and allowed in message and repr(value).strip("'") in message


def test_adaptive_accepts_fractional_average():
    assert Config(policy="adaptive", bits=1.5).bits == 1.5
    with pytest.raises(ValueError, match="average in \\[1, 8\\]"):
        Config(policy="adaptive", bits=9)


@pytest.mark.parametrize("text, size", [("512MiB", 512 * 2**20), ("1.5 GB", 1_500_000_000), ("4096", 4096),
                                        ("64kib", 65536), (100, 100)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_replace_validates_and_rejects_unknown_fields():
    assert Config().replace(bits=4).bits == 4
    with pytest.raises(ValueError, match="unknown Config field"):
        Config().replace(bitz=4)
    with pytest.raises(ValueError, match="Config.bits"):
        Config().replace(bits=5)


def test_round_trips_through_json():
    c = Config(bits=4, budget="1MiB", rounding="nearest", seed=7)
    again = Config.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.to_dict()["version"] == 1


def test_unknown_version_is_refused():
    data = Config().to_dict()
    data["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        Config.from_dict(data)


@pytest.mark.parametrize("make", [lambda: Config(bitz=2), lambda: Config().replace(bitz=2),
                                  lambda: Config.from_dict({"bitz": 2})])
def test_unknown_keyword_is_a_value_error_naming_it_and_the_allowed_fields(make):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "unknown Config field" in message and "'bitz'" in message and "did you mean 'bits'" in message
    assert "allowed: allocator, backend, background, bits, budget" in message and "spill_dir" in message


def test_wrap_and_compress_refuse_an_unknown_keyword_the_same_way():
    import daf
    from torch import nn
    for make in (lambda: daf.wrap(nn.Linear(2, 2), bitz=2), lambda: daf.wrap(nn.Linear(2, 2), Config(), bitz=2)):
        with pytest.raises(ValueError, match="unknown Config field.*'bitz'.*allowed: .*bits"):
            make()
    with pytest.raises(ValueError, match="unknown Config field.*'bitz'"):
        with daf.compress(bitz=2):
            pass


@pytest.mark.parametrize("field, value", [("bits", 1.5), ("bits", 4), ("budget", "12XB"), ("spill_dir", "/nowhere"),
                                          ("bitz", 2)])
def test_a_config_cannot_be_changed_after_it_is_validated(field, value):
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError,
                       match=rf"daf.Config is immutable: cannot set '{field}'; use config.replace\({field}=...\)"):
        setattr(c, field, value)
    with pytest.raises(AttributeError, match="immutable"):  # FrozenInstanceError is an AttributeError
        delattr(c, "bits")
    assert c == Config() and c.bits == 2 and c.budget is None


def test_frozen_config_still_copies_hashes_and_pickles():
    c = Config(policy="adaptive", bits=1.5, budget="1MiB")
    assert c.replace(bits=2.0).bits == 2.0 and c.bits == 1.5
    assert Config(bits=4.0).bits == 4 and isinstance(Config(bits=4.0).bits, int)  # normalized in __post_init__
    assert Config(budget="1KiB").budget == 1024
    assert pickle.loads(pickle.dumps(c)) == c and copy.deepcopy(c) == c and hash(c) == hash(c.replace())
    assert {c: 1}[Config(policy="adaptive", bits=1.5, budget=2**20)] == 1


def test_spill_dir_is_checked_when_the_config_is_made(tmp_path, monkeypatch):
    assert Config(spill_dir=str(tmp_path)).spill_dir == str(tmp_path)
    assert Config(spill_dir=None).spill_dir is None
    missing, a_file = tmp_path / "missing", tmp_path / "file"
    a_file.write_text("")
    for path, why in ((missing, "it does not exist"), (a_file, "it is not a directory")):
        with pytest.raises(ValueError) as info:
            Config(spill_dir=str(path))
        message = str(info.value)
        assert "Config.spill_dir" in message and repr(str(path)) in message and why in message
        assert "an existing directory this process can write to, or None" in message
    with pytest.raises(ValueError, match="Config.spill_dir must be .* as a path string; got 3"):
        Config(spill_dir=3)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root may write anywhere: let os.access say what a user would see
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    with pytest.raises(ValueError, match=rf"Config.spill_dir .*{re.escape(repr(str(locked)))}: it is not writable"):
        Config(spill_dir=str(locked))
