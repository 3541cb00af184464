import json

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
