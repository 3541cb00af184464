import copy
import dataclasses
import json
import os
import pickle
import re

import pytest

import daf
from daf import Adaptive, Audit, Auto, Config, Division, MinMax, Outliers, Uniform
from daf.config import CONFIG_VERSION, REMAKES, parse_size


def test_defaults_are_valid():
    c = Config()
    assert (c.bits, c.group_size, c.rounding, c.policy, c.codec) == (None, 256, "auto", Auto(),
                                                                      Outliers(above=8.0, min_channels=32))
    assert (daf.Auto, daf.Uniform, daf.Adaptive, daf.MinMax, daf.Division) == (Auto, Uniform, Adaptive, MinMax, Division)


@pytest.mark.parametrize("field, value, allowed", [
    ("bits", 3, "one of (1, 2, 4, 8)"),
    ("bits", "2", "one of (1, 2, 4, 8)"),
    ("group_size", 100, "power of two"),
    ("group_size", 8, "in [16, 1048576]"),
    ("rounding", "up", "'auto', 'stochastic', 'nearest'"),
    ("min_numel", -1, ">= 0"),
    ("seed", 1.5, "integer"),
    ("policy", "greedy", "daf.Auto(...), daf.Uniform(), daf.Adaptive(...)"),
    ("codec", "zip", "daf.MinMax(), daf.Division()"),
    ("backend", "cuda", "'auto', 'native', 'reference'"),
    ("budget", "lots", "could not parse"),
    ("budget", -5, "positive"),
    ("budget", 1e30, "a number of bytes in [1, 2**60]"),
    ("budget", 10**30, "a number of bytes in [1, 2**60]"),
    ("budget", "9999999TiB", "a number of bytes in [1, 2**60]"),
    ("min_bits", 3, "one of (1, 2, 4, 8)"),
    ("page_size", 5000, "power of two"),
    ("background", "yes", "True or False"),
    ("return_pages", 1, "True or False"),
    ("decommit", "yes", "True or False"),
    ("floors", {"layer_norm": 3}, "bits in (1, 2, 4, 8)"),
    ("floors", {"": 4}, "torch function names"),
    ("floors", "layer_norm=4", "e.g. {'layer_norm': 4}"),
    ("floors", [("linear", 4), ("linear", 8)], "each function once"),
    ("floors", 4, "a mapping from torch function names"),
    ("floors", {"layernorm": 4}, "'layernorm' is no function of torch.nn.functional, torch or torch.Tensor "
                                 "(did you mean 'layer_norm'?)"),
])
def test_bad_values_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        Config(**{field: value})
    message = str(info.value)
    assert f"Config.{field}" in message and allowed in message and repr(value).strip("'") in message


@pytest.mark.parametrize("bits, min_bits", [(2, 8), (2, 4), (1, 4), (4, 8)])
def test_min_bits_above_bits_is_a_value_error_naming_both_and_the_allowed(bits, min_bits):
    with pytest.raises(ValueError) as info:
        Config(bits=bits, min_bits=min_bits)
    message = str(info.value)
    assert f"Config.min_bits={min_bits}" in message and f"Config.bits={bits}" in message and "one of (1, 2" in message


def test_min_bits_at_most_bits_and_the_default_under_one_bit_are_accepted():
    assert Config(bits=8, min_bits=8).min_bits == 8 and Config(bits=1).min_bits == 2
    assert Config(policy=Adaptive(average=1.5), min_bits=4).min_bits == 4  # the plan's widths vary


def test_adaptive_takes_a_fractional_average_and_validates_its_knobs():
    assert Config(policy=Adaptive(average=1.5)).policy.average == 1.5
    assert Adaptive(average=2).average == 2.0 and isinstance(Adaptive(average=2).average, float)
    with pytest.raises(ValueError, match=r"Adaptive.average must be a number in \[1, 8\], got 9"):
        Adaptive(average=9)


@pytest.mark.parametrize("field, value, allowed", [
    ("average", 0.5, "a number in [1, 8]"),
    ("average", "2", "a number in [1, 8]"),
    ("replan_every", 0, "an integer >= 1"),
    ("replan_every", 2.0, "an integer >= 1"),
    ("window", 0, "an integer >= 1"),
    ("smoothing", 1.0, "a number in [0, 1)"),
    ("min_gain", 1.5, "a number in [0, 1]"),
    ("allow_raw", 1, "True or False"),
])
def test_bad_adaptive_knobs_name_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ValueError) as info:
        Adaptive(**{field: value})
    message = str(info.value)
    assert f"Adaptive.{field} must be {allowed}, got {value!r}" in message


def test_typed_configs_refuse_unknown_keywords_and_assignment():
    with pytest.raises(ValueError, match="unknown Adaptive field.*'averge' \\(did you mean 'average'\\?\\)"):
        Adaptive(averge=2.0)
    with pytest.raises(ValueError, match="unknown Uniform field.*'bits'"):
        Uniform(bits=2)
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"daf.Adaptive is immutable.*dataclasses.replace"):
        Adaptive().average = 3.0
    assert dataclasses.replace(Adaptive(), average=3).average == 3.0
    with pytest.raises(ValueError, match="Adaptive.average"):
        dataclasses.replace(Adaptive(), average=10)


@pytest.mark.parametrize("kwargs, says", [
    (dict(policy="adaptive"), "write policy=daf.Adaptive(average=2.0)"),
    (dict(policy="adaptive", bits=1.5), "write policy=daf.Adaptive(average=1.5)"),
    (dict(policy="uniform"), "write policy=daf.Uniform()"),
    (dict(codec="division"), "write codec=daf.Division()"),
    (dict(codec="minmax"), "write codec=daf.MinMax()"),
    (dict(bits=1.5), "Config.bits must be one of (1, 2, 4, 8) (the code width of the Uniform policy), got 1.5; "
                     "for an average of 1.5 bits per element write policy=daf.Adaptive(average=1.5)"),
    (dict(bits=4, policy=Adaptive()), "write policy=daf.Adaptive(average=4.0) and leave bits out"),
    (dict(replan_every=10), "write policy=daf.Adaptive(replan_every=...)"),
    (dict(policy=Division()), "Config.policy must be one of daf.Auto(...), daf.Uniform(), daf.Adaptive(...)"),
    (dict(codec=Adaptive()), "Config.codec must be one of daf.MinMax(), daf.Division()"),
])
def test_the_old_string_and_number_forms_say_what_to_write_instead(kwargs, says):
    with pytest.raises(ValueError) as info:
        Config(**kwargs)
    assert says in str(info.value)


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


@pytest.mark.parametrize("config", [
    Config(bits=4, budget="1MiB", rounding="nearest", seed=7),
    Config(policy=Adaptive(average=1.5, replan_every=7, window=2, smoothing=0.5, min_gain=0.1, allow_raw=False),
           codec=Division(), masks=False),
    Config(bits=8, codec=Division(), allocator="system"),
    Config(floors={"linear": 4, "layer_norm": 8}),
    Config(audit=Audit(every=7, fraction=0.5, threshold=0.9, first=False)),
])
def test_round_trips_through_json(config):
    data = config.to_dict()
    assert data["version"] == CONFIG_VERSION == 2
    assert data["policy"]["kind"] in ("auto", "uniform", "adaptive")
    assert data["codec"]["kind"] in ("minmax", "division", "outliers")
    again = Config.from_dict(json.loads(json.dumps(data)))
    assert again == config and again.to_dict() == data


def test_typed_configs_serialize_with_their_kind_and_fields():
    data = Config(policy=Adaptive(average=1.5), codec=Division()).to_dict()
    assert data["policy"] == {"kind": "adaptive", "average": 1.5, "replan_every": 50, "window": 4, "smoothing": 0.7,
                              "min_gain": 0.25, "allow_raw": True, "generic": "hold"}
    assert data["codec"] == {"kind": "division"} and Config(bits=2).to_dict()["policy"] == {"kind": "uniform"}
    assert Config().to_dict()["policy"] == {"kind": "auto", "bits": 4, "feature_map_bits": 2, "sensitive_bits": 8}
    assert "replan_every" not in data


def test_from_dict_fills_missing_fields_with_defaults():
    assert Config.from_dict({"policy": {"kind": "adaptive", "average": 3.0}}) == Config(policy=Adaptive(average=3.0))
    assert Config.from_dict({}) == Config()
    with pytest.raises(ValueError, match="needs a 'kind'"):
        Config.from_dict({"policy": {"average": 3.0}})
    with pytest.raises(ValueError, match="needs a 'kind'"):
        Config.from_dict({"codec": {"kind": "zip"}})
    with pytest.raises(ValueError, match="unknown Adaptive field.*'averge'"):
        Config.from_dict({"policy": {"kind": "adaptive", "averge": 3.0}})


# What version-1 records held (docs/results/*.json): string policy and codec, bits an average under
# the adaptive policy, replan_every at the top.
_V1 = {"bits": 2, "group_size": 256, "rounding": "stochastic", "min_numel": 4096, "seed": 0, "policy": "uniform",
       "codec": "minmax", "backend": "auto", "budget": None, "min_bits": 2, "replan_every": 50, "page_size": 4096,
       "spill_dir": None, "background": False, "masks": True, "allocator": "auto", "version": 1}


@pytest.mark.parametrize("changes, expected", [
    ({}, Config(bits=2, codec=MinMax(), rounding="stochastic")),  # what version 1 wrote is kept: uniform 2-bit MinMax, not today's default
    ({"bits": 4, "codec": "division"}, Config(bits=4, codec=Division(), rounding="stochastic")),
    ({"policy": "adaptive", "bits": 1.5, "replan_every": 7},
     Config(policy=Adaptive(average=1.5, replan_every=7), codec=MinMax(), rounding="stochastic")),
    ({"policy": "adaptive", "bits": 4.0}, Config(policy=Adaptive(average=4.0), codec=MinMax(), rounding="stochastic")),
    ({"replan_every": 3}, Config(bits=2, codec=MinMax(), rounding="stochastic")),  # it did nothing under the uniform policy
])
def test_version_1_dicts_are_migrated(changes, expected):
    data = {**_V1, **changes}
    assert Config.from_dict(data) == expected
    assert Config.from_dict(json.loads(json.dumps(data))).to_dict()["version"] == 2


def test_version_1_dicts_of_older_records_lacking_later_fields_are_migrated():
    old = {k: v for k, v in _V1.items() if k not in ("masks", "allocator")}
    assert Config.from_dict({**old, "policy": "adaptive", "bits": 2.0}) == Config(policy=Adaptive(average=2.0),
                                                                                  codec=MinMax(), rounding="stochastic")


@pytest.mark.parametrize("changes, says", [({"policy": "greedy"}, "version-1 Config.policy"),
                                           ({"codec": "zip"}, "version-1 Config.codec"),
                                           ({"policy": "adaptive", "bits": 9}, "Adaptive.average")])
def test_bad_version_1_dicts_are_refused(changes, says):
    with pytest.raises(ValueError, match=says):
        Config.from_dict({**_V1, **changes})


@pytest.mark.parametrize("make", [lambda: Config(bitz=2), lambda: Config().replace(bitz=2),
                                  lambda: Config.from_dict({"bitz": 2})])
def test_unknown_keyword_is_a_value_error_naming_it_and_the_allowed_fields(make):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "unknown Config field" in message and "'bitz'" in message and "did you mean 'bits'" in message
    assert "allowed: allocator, audit, backend, background, bits, budget" in message and "spill_dir" in message


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
    assert c == Config() and c.bits is None and c.budget is None


def test_frozen_config_still_copies_hashes_and_pickles():
    c = Config(policy=Adaptive(average=1.5), budget="1MiB")
    assert c.replace(policy=Adaptive(average=2.0)).policy.average == 2.0 and c.policy.average == 1.5
    assert Config(bits=4.0).bits == 4 and isinstance(Config(bits=4.0).bits, int)  # normalized in __post_init__
    assert Config(budget="1KiB").budget == 1024
    assert pickle.loads(pickle.dumps(c)) == c and copy.deepcopy(c) == c and hash(c) == hash(c.replace())
    assert {c: 1}[Config(policy=Adaptive(average=1.5), budget=2**20)] == 1


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


def test_floors_are_sorted_pairs_a_dict_in_json_and_named_floors_only():
    config = Config(floors={"scaled_dot_product_attention": 4, "layer_norm": 8})
    assert config.floors == (("layer_norm", 8), ("scaled_dot_product_attention", 4))
    assert Config(floors=[("layer_norm", 8), ("scaled_dot_product_attention", 4)]) == config
    assert config.to_dict()["floors"] == {"layer_norm": 8, "scaled_dot_product_attention": 4}
    assert (config.floor_for("layer_norm"), config.floor_for("linear"), config.floor_for(None)) == (8, 1, 1)
    assert Config().floors == () and Config.from_dict({"bits": 4}).floors == ()


@pytest.mark.parametrize("kwargs, says", [
    ({"every": -1}, "Audit.every must be an integer >= 0, got -1"),
    ({"every": 2.5}, "Audit.every must be an integer"),
    ({"fraction": 0}, "Audit.fraction must be a number in (0, 1], got 0; to turn the audit off"),
    ({"fraction": 1.5}, "Audit.fraction must be a number in [0, 1], got 1.5"),
    ({"threshold": 2}, "Audit.threshold must be a number in [0, 1], got 2"),
    ({"nearest_threshold": -0.5}, "Audit.nearest_threshold must be a number in [0, 1], got -0.5"),
    ({"first": 1}, "Audit.first must be True or False, got 1"),
    ({"min_samples": 0}, "Audit.min_samples must be an integer >= 1, got 0"),
    ({"evry": 3}, "unknown Audit field(s) 'evry' (did you mean 'every'?)"),
])
def test_audit_values_are_checked_and_the_error_names_the_field(kwargs, says):
    with pytest.raises(ValueError) as error:
        Audit(**kwargs)
    assert says in str(error.value)


def test_config_audit_takes_an_audit_and_old_dicts_without_it_get_the_default():
    with pytest.raises(ValueError, match=r"Config.audit must be a daf.Audit\(...\)"):
        Config(audit=50)
    assert Config().audit == Audit() and Config().to_dict()["audit"] == {"every": 50, "fraction": 0.125,
                                                                          "threshold": Audit().threshold, "first": True,
                                                                          "min_samples": 4,
                                                                          "nearest_threshold": Audit().nearest_threshold}
    data = Config(bits=4).to_dict()
    del data["audit"]
    assert Config.from_dict(data) == Config(bits=4)


def test_remakes_are_rule_names_in_the_table_order_a_list_in_json_and_checked():
    assert Config().remakes == REMAKES
    config = Config(remakes=["norm_block", "activation"])
    assert config.remakes == ("activation", "norm_block")
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert Config.from_dict({k: v for k, v in Config().to_dict().items() if k != "remakes"}).remakes == REMAKES
    assert Config(remakes=()).remakes == ()
    for value, says in (("activation", "must be a sequence of names"), (["head"], "no remake rule named 'head'"),
                        (["activation", "activation"], "names each rule once"), (None, "must be a sequence")):
        with pytest.raises(ValueError, match=says):
            Config(remakes=value)
