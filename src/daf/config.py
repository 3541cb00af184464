"""The one configuration object of DAF, validated in one place.

>>> Config(bits=4).bits
4
>>> Config(budget="1.5MiB").budget
1572864
>>> Config(bits=3)
Traceback (most recent call last):
...
ValueError: Config.bits must be one of (1, 2, 4, 8) with policy='uniform', got 3

A ``Config`` is immutable; ``replace`` gives a validated copy:

>>> c = Config()
>>> c.bits = 4
Traceback (most recent call last):
...
dataclasses.FrozenInstanceError: daf.Config is immutable: cannot set 'bits'; use config.replace(bits=...) for a validated copy
>>> c.replace(bits=4).bits
4
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any

from daf.allocator.libraries import ALLOCATORS

__all__ = ["Config", "Uniform", "Adaptive", "MinMax", "Division", "parse_size", "ALLOWED_BITS"]

ALLOWED_BITS = (1, 2, 4, 8)
CONFIG_VERSION = 1

_ROUNDINGS = ("stochastic", "nearest")
_POLICIES = ("uniform", "adaptive")
_CODECS = ("minmax", "division")
_BACKENDS = ("auto", "native", "reference")
_ALLOCATORS = ("auto", "system", *ALLOCATORS)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str | None, name: str = "size") -> int | None:
    """Bytes from an int or a string such as ``"512MiB"``, ``"1.5 GB"``, ``"4096"``.

    >>> parse_size("512MiB")
    536870912
    >>> parse_size(None) is None
    True
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"Config.{name} must be a byte count or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"Config.{name} must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"Config.{name} could not parse {value!r}: write a number with an optional unit "
                f"from B, KB, MB, GB, KiB, MiB, GiB, TiB (e.g. '512MiB')"
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
        if size <= 0:
            raise ValueError(f"Config.{name} must be positive, got {value!r}")
        return size
    raise ValueError(f"Config.{name} must be a byte count or a string like '512MiB', got {value!r}")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_field_names(names: Any) -> None:
    """``ValueError`` naming the unknown ones among ``names`` (keywords of ``Config`` or ``replace``)."""
    known = [f.name for f in dataclasses.fields(Config)]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    allowed = sorted(set(known) - {"version"})
    hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, allowed, 1))
             else repr(name) for name in unknown]
    raise ValueError(f"unknown Config field(s) {', '.join(hints)}; allowed: {', '.join(allowed)}")


def _immutable(cls: type) -> type:
    """Make a frozen dataclass say how to change it, and refuse unknown keywords with ``ValueError``.

    ``Config(bitz=2)`` would raise ``TypeError`` from the generated ``__init__``; ``daf.wrap(m, bitz=2)``
    and ``replace`` raise ``ValueError``: both now do. Assigning or deleting a field raises
    ``dataclasses.FrozenInstanceError`` (an ``AttributeError``) pointing at ``replace``, so a
    changed value can never skip validation.
    """
    generated_init = cls.__init__

    @functools.wraps(generated_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _check_field_names(kwargs)
        generated_init(self, *args, **kwargs)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(
            f"daf.Config is immutable: cannot set {name!r}; use config.replace({name}=...) "
            f"for a validated copy")

    def __delattr__(self: Any, name: str) -> None:
        raise dataclasses.FrozenInstanceError(
            f"daf.Config is immutable: cannot delete {name!r}; use config.replace({name}=...) "
            f"for a validated copy")

    cls.__init__, cls.__setattr__, cls.__delattr__ = __init__, __setattr__, __delattr__
    return cls


@_immutable
@dataclass(frozen=True)
class Config:
    """How DAF compresses the activations of one wrapped model.

    Every field is checked in ``__post_init__``; a bad value raises ``ValueError``
    naming the field, the value and what is allowed, and so does an unknown keyword.
    A ``Config`` is immutable (hashable too): ``config.replace(bits=4)`` returns a
    validated copy; assigning a field raises ``dataclasses.FrozenInstanceError``.

    Attributes:
        bits: code width per element, one of 1, 2, 4, 8 with ``policy="uniform"``;
            with ``policy="adaptive"`` the average bits per element (a float in [1, 8]).
        group_size: elements sharing one min/scale pair; a power of two in [16, 2**20].
        rounding: "stochastic" (unbiased, default) or "nearest".
        min_numel: tensors with fewer elements are kept as they are.
        seed: seed of the counter-based generator used by stochastic rounding.
        policy: "uniform" (every site gets ``bits``) or "adaptive" (bits per site from importance).
        codec: "minmax" (per-group min/scale) or "division" (DIVISION dual precision for 4-D activations).
        backend: "auto" (native kernels when they build, else reference), "native" or "reference".
        budget: memory budget for stored activations, bytes or a string like "512MiB"; None for no limit.
        min_bits: the fewest bits demotion may go down to under a budget. 2 by default: demoting to
            1 bit wrecked training in the 200-step budget benchmark (docs/paging.md).
        replan_every: steps between two re-plans of the adaptive policy.
        page_size: bytes per page of the activation pool; a power of two in [4KiB, 64MiB]. Each record
            wastes half a page on average: 4KiB keeps that under 1% on ResNet-18 (docs/paging.md).
        spill_dir: parent directory for the private spill directory: an existing directory this process
            may write to, checked here; None uses the system temp dir.
        background: compress on a worker thread while forward goes on.
        masks: store exact 1-bit masks where that is all backward needs: ReLU's own saved output
            (read by its backward only as ``result <= 0`` or not) and tensors holding two values (dropout
            masks, booleans). Lossless; on by default (docs/policy.md).
        allocator: where PyTorch's CPU tensors come from once DAF is attached: "auto" (the best
            allocator found, tcmalloc first), "system" (leave the process as it is), or "tcmalloc",
            "jemalloc", "mimalloc". Process-wide by nature; the system malloc keeps freed
            temporaries' memory, so without this the process barely shrinks (docs/allocator.md).
    """

    bits: float = 2
    group_size: int = 256
    rounding: str = "stochastic"
    min_numel: int = 4096
    seed: int = 0
    policy: str = "uniform"
    codec: str = "minmax"
    backend: str = "auto"
    budget: int | str | None = None
    min_bits: int = 2
    replan_every: int = 50
    page_size: int = 4096
    spill_dir: str | None = None
    background: bool = False
    masks: bool = True
    allocator: str = "auto"
    version: int = field(default=CONFIG_VERSION, repr=False)

    def __post_init__(self) -> None:
        self._check_bits()
        _check_int("group_size", self.group_size, 16, 2**20)
        if not _is_power_of_two(self.group_size):
            raise ValueError(f"Config.group_size must be a power of two in [16, 1048576], got {self.group_size}")
        _check_choice("rounding", self.rounding, _ROUNDINGS)
        _check_int("min_numel", self.min_numel, 0, None)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_choice("codec", self.codec, _CODECS)
        _check_choice("backend", self.backend, _BACKENDS)
        object.__setattr__(self, "budget", parse_size(self.budget, "budget"))
        _check_choice("min_bits", self.min_bits, ALLOWED_BITS)
        _check_int("replan_every", self.replan_every, 1, None)
        _check_int("page_size", self.page_size, 4096, 64 * 2**20)
        if not _is_power_of_two(self.page_size):
            raise ValueError(f"Config.page_size must be a power of two in [4096, 67108864], got {self.page_size}")
        _check_spill_dir(self.spill_dir)
        if not isinstance(self.background, bool):
            raise ValueError(f"Config.background must be True or False, got {self.background!r}")
        if not isinstance(self.masks, bool):
            raise ValueError(f"Config.masks must be True or False, got {self.masks!r}")
        _check_choice("allocator", self.allocator, _ALLOCATORS)
        if self.version != CONFIG_VERSION:
            raise ValueError(f"Config.version {self.version} is not supported; this DAF reads version {CONFIG_VERSION}")

    def _check_bits(self) -> None:
        _check_choice("policy", self.policy, _POLICIES)
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
            raise ValueError(f"Config.bits must be a number, got {self.bits!r}")
        if self.policy == "uniform":
            if self.bits not in ALLOWED_BITS:
                raise ValueError(f"Config.bits must be one of {ALLOWED_BITS} with policy='uniform', got {self.bits}")
            object.__setattr__(self, "bits", int(self.bits))
        elif not 1 <= self.bits <= 8:
            raise ValueError(f"Config.bits must be an average in [1, 8] with policy='adaptive', got {self.bits}")

    def replace(self, **overrides: Any) -> "Config":
        """A validated copy with some fields changed; unknown names raise ``ValueError``."""
        _check_field_names(overrides)
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with a version, for JSON; ``Config.from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        return cls().replace(**data)


@dataclass(frozen=True)
class Uniform:
    """Bit policy: every compressed site gets ``Config.bits``."""


@dataclass(frozen=True)
class Adaptive:
    """Bit policy: bits per site from measured importance, at a size-weighted ``average`` (docs/policy.md).

    Knobs are those of ``daf.policy.AdaptivePolicy``.
    """

    average: float = 2.0
    replan_every: int = 50
    window: int = 4
    smoothing: float = 0.7
    min_gain: float = 0.25
    allow_raw: bool = True


@dataclass(frozen=True)
class MinMax:
    """Codec: per-group min/scale codes (format 1)."""


@dataclass(frozen=True)
class Division:
    """Codec: DIVISION dual precision for convolutional feature maps, MinMax for everything else."""


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Config.{name} must be an integer {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"Config.{name} must be an integer {allowed}, got {value}")


def _check_spill_dir(path: Any) -> None:
    """``spill_dir`` is None or an existing directory this process may create files in (checked now,
    not at the first spill, which may come hours into training)."""
    if path is None:
        return
    allowed = "an existing directory this process can write to, or None (a private directory under the system temp dir)"
    if not isinstance(path, str):
        raise ValueError(f"Config.spill_dir must be {allowed}, as a path string; got {path!r}")
    if not os.path.isdir(path):
        why = "it is not a directory" if os.path.exists(path) else "it does not exist"
        raise ValueError(f"Config.spill_dir must be {allowed}; got {path!r}: {why}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"Config.spill_dir must be {allowed}; got {path!r}: it is not writable")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"Config.{name} must be one of {allowed}, got {value!r}")
