"""The one configuration object of DAF, validated in one place.

>>> Config(bits=4).bits
4
>>> Config(budget="1.5MiB").budget
1572864
>>> Config(policy=Adaptive(average=1.5)).policy.average
1.5
>>> Config(bits=3)
Traceback (most recent call last):
...
ValueError: Config.bits must be one of (1, 2, 4, 8) (the code width of the Uniform policy), got 3; for an average of 3 bits per element write policy=daf.Adaptive(average=3.0)

A ``Config`` is immutable; ``replace`` gives a validated copy:

>>> c = Config()
>>> c.bits = 4
Traceback (most recent call last):
...
dataclasses.FrozenInstanceError: daf.Config is immutable: cannot set 'bits'; use config.replace(bits=...) for a validated copy
>>> c.replace(bits=4).bits
4

The bit policy and the codec are typed configs (``Uniform``/``Adaptive``, ``MinMax``/``Division``),
each validated when it is made; ``daf.policy.register_policy`` adds policy config types.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from daf.allocator.libraries import ALLOCATORS
from daf.format import ALLOWED_BITS

__all__ = ["Config", "Auto", "Uniform", "Adaptive", "MinMax", "Division", "Outliers", "Audit", "parse_size",
           "register_config_type", "ALLOWED_BITS", "CONFIG_VERSION", "ROUNDINGS", "REMAKES", "parse_remakes",
           "stochastic_at"]

# 2: policy and codec are typed configs ({"kind": ..., fields}), replan_every moved into Adaptive,
# bits is only the uniform width. Version-1 dicts are migrated by ``Config.from_dict``.
CONFIG_VERSION = 2
UNIFORM_BITS = 2  # the Uniform policy's width when none is given

ROUNDINGS = ("auto", "stochastic", "nearest")
# "auto" rounds codes of this many bits and more to nearest: there the step is fine enough that nearest
# rounding's error (at most half a step, the same for the same value at every step) costs less than
# stochastic rounding's doubled variance; coarser codes keep stochastic rounding's unbiasedness
# (docs/default.md, "Rounding to nearest from 4 bits").
NEAREST_FROM_BITS = 4
# The remake rules (daf.runtime.remakes, in the order they are asked): saves recomputed in backward from
# records of the same forward instead of stored. Each trades a recomputation for memory; the costliest is
# the head's, a language model's head matmul again (8.6% of a SmolLM2 step, docs/transformers.md, section 8).
REMAKES = ("activation", "attention_output", "attention_map", "head_log_probabilities", "norm_block", "view")


def stochastic_at(rounding: str, bits: int) -> bool:
    """Whether codes of ``bits`` are rounded stochastically under ``rounding`` (one of ``ROUNDINGS``)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    return rounding == "stochastic" or (rounding == "auto" and bits < NEAREST_FROM_BITS)

GENERIC_MODES = ("hold", "floor", "trade")  # what Adaptive.generic may be (daf.policy.adaptive reads it)
_AXES = ("channel", "token")  # of Outliers
_BACKENDS = ("auto", "native", "reference")
_ALLOCATORS = ("auto", "system", *ALLOCATORS)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
# Fields that left Config, and where they went.
_MOVED = {"replan_every": "it belongs to the adaptive policy: write policy=daf.Adaptive(replan_every=...)"}


_MAX_SIZE = 2**60  # 1 EiB: larger sizes are mistakes, not budgets


def parse_size(value: int | str | None, name: str = "size") -> int | None:
    """Bytes from an int or a string such as ``"512MiB"``, ``"1.5 GB"``, ``"4096"``.

    >>> parse_size("512MiB")
    536870912
    >>> parse_size(None) is None
    True
    """
    if value is None:
        return None
    allowed = f"a number of bytes in [1, 2**60] (an int, or a string like '512MiB'), or None for no limit"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"Config.{name} must be {allowed}, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
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
    if size > _MAX_SIZE:  # no machine holds it: a typo, or "no limit" spelt as a number
        raise ValueError(f"Config.{name} must be {allowed}, got {value!r}")
    return size


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_field_names(cls: type, names: Any) -> None:
    """``ValueError`` naming the unknown ones among ``names`` (keywords of ``cls`` or its ``replace``)."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    moved = [f"{name!r} ({_MOVED[name]})" for name in unknown if cls is Config and name in _MOVED]
    if moved:
        raise ValueError(f"Config has no field {', '.join(moved)}")
    allowed = sorted(set(known) - {"version"})
    hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, allowed, 1))
             else repr(name) for name in unknown]
    raise ValueError(f"unknown {cls.__name__} field(s) {', '.join(hints)}; allowed: {', '.join(allowed) or 'none'}")


def _immutable(cls: type) -> type:
    """Make a frozen dataclass say how to change it, and refuse unknown keywords with ``ValueError``.

    ``Config(bitz=2)`` would raise ``TypeError`` from the generated ``__init__``; ``daf.wrap(m, bitz=2)``
    and ``replace`` raise ``ValueError``: both now do. Assigning or deleting a field raises
    ``dataclasses.FrozenInstanceError`` (an ``AttributeError``) pointing at ``replace``, so a
    changed value can never skip validation.
    """
    generated_init = cls.__init__
    name = cls.__name__

    @functools.wraps(generated_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _check_field_names(cls, kwargs)
        generated_init(self, *args, **kwargs)

    def refuse(verb: str, field_name: str) -> dataclasses.FrozenInstanceError:
        call = "config.replace(" if name == "Config" else f"dataclasses.replace({name.lower()}, "
        return dataclasses.FrozenInstanceError(
            f"daf.{name} is immutable: cannot {verb} {field_name!r}; use {call}{field_name}=...) "
            f"for a validated copy")

    def __setattr__(self: Any, field_name: str, value: Any) -> None:
        raise refuse("set", field_name)

    def __delattr__(self: Any, field_name: str) -> None:
        raise refuse("delete", field_name)

    cls.__init__, cls.__setattr__, cls.__delattr__ = __init__, __setattr__, __delattr__
    return cls


def _check_int(name: str, value: Any, low: int, high: int | None, owner: str = "Config") -> None:
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an integer {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{owner}.{name} must be an integer {allowed}, got {value}")


def _check_number(label: str, value: Any, low: float, high: float, high_open: bool = False) -> None:
    allowed = f"in [{low}, {high})" if high_open else f"in [{low}, {high}]"
    if not _is_number(value) or not low <= value <= high or (high_open and value == high):
        raise ValueError(f"{label} must be a number {allowed}, got {value!r}")


def _check_bool(label: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be True or False, got {value!r}")


def _check_choice_of(label: str, value: Any, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"{label} must be one of {allowed}, got {value!r}")


# -- typed configs of the bit policy and the codec --------------------------------------------------

@_immutable
@dataclass(frozen=True)
class Auto:
    """Bit policy of ``Config()`` (the default): a width per save from what reads it in backward, so that
    one line, ``daf.wrap(model)``, keeps any model's gradient (docs/policy.md, "The default").

    Attributes:
        bits: what a linear, matmul, norm or activation saves (transformers' saves), 1, 2, 4 or 8.
        feature_map_bits: what a convolution, batch norm, pooling or the activations between them save
            (a CNN's feature maps, 3-D and more): 2 bits train ResNet-18 within half a point of fp32.
        sensitive_bits: what backward reads through a saturating derivative (tanh's and sigmoid's
            outputs, softmax's probabilities) and fused attention's v: an error there is not averaged out.
    Fused attention's q and k get the fewest bits whose predicted logit error is small, or stay raw
    (``daf.policy.exponent_guard.logit_bits``), whatever the policy.
    """

    bits: int = 4
    feature_map_bits: int = 2
    sensitive_bits: int = 8

    def __post_init__(self) -> None:
        for name in ("bits", "feature_map_bits", "sensitive_bits"):
            _check_choice_of(f"Auto.{name}", getattr(self, name), ALLOWED_BITS)


@_immutable
@dataclass(frozen=True)
class Uniform:
    """Bit policy: every compressed site gets ``Config.bits`` (1, 2, 4 or 8)."""


@_immutable
@dataclass(frozen=True)
class Adaptive:
    """Bit policy: bits per site from measured importance, at a size-weighted ``average`` (docs/policy.md).

    Attributes:
        average: bits per element over the compressed sites, in [1, 8] (fractions allowed: 1.5).
        replan_every: forwards between two plans.
        window: forwards watched by the importance estimator before each plan.
        smoothing: weight of the previous estimate when a new one is folded in, in [0, 1).
        min_gain: a plan replaces uniform bits only if its estimated variance is at least this
            fraction below theirs, in [0, 1] (the estimates are good to a factor of 2-3 per site).
        allow_raw: whether the plan may keep a site raw (counted at its dtype's bits).
        generic: what the plan does with a site its estimator costs by the generic model (a norm,
            activation, softmax or attention-product input, whose estimate is unsure): "hold" keeps it
            at the uniform width (default), "floor" may raise it but never cut it, "trade" trades it
            like any other (docs/policy.md, "Where the model is unsure").
    """

    average: float = 2.0
    replan_every: int = 50
    window: int = 4
    smoothing: float = 0.7
    min_gain: float = 0.25
    allow_raw: bool = True
    generic: str = "hold"

    def __post_init__(self) -> None:
        _check_number("Adaptive.average", self.average, 1, 8)
        object.__setattr__(self, "average", float(self.average))
        _check_int("replan_every", self.replan_every, 1, None, owner="Adaptive")
        _check_int("window", self.window, 1, None, owner="Adaptive")
        _check_number("Adaptive.smoothing", self.smoothing, 0, 1, high_open=True)
        _check_number("Adaptive.min_gain", self.min_gain, 0, 1)
        _check_bool("Adaptive.allow_raw", self.allow_raw)
        if self.generic not in GENERIC_MODES:
            raise ValueError(f"Adaptive.generic must be one of {GENERIC_MODES}, got {self.generic!r}")


@_immutable
@dataclass(frozen=True)
class MinMax:
    """Codec: per-group min/scale codes (format 1)."""


@_immutable
@dataclass(frozen=True)
class Division:
    """Codec: DIVISION dual precision for convolutional feature maps, MinMax for everything else."""


@_immutable
@dataclass(frozen=True)
class Outliers:
    """Codec for transformer activations [..., channels] (docs/transformers.md): the residual stream's
    outlier channels kept exact, the other channels coded per group along ``axis``; MinMax for the rest.

    Attributes:
        fraction: share of the channels (the largest by max |x|) kept exact, in [0, 0.5]; at least one
            when positive.
        axis: "channel" (a group runs along the tokens of a channel, each token scaled by its largest
            inlier first; measured best on SmolLM2 and MiniLM) or "token" (along the channels of a token,
            as MinMax).
        derivatives: store the input of GELU / SiLU as a 2-bit code of its derivative (Approx-BP), which
            is all their backward reads. Only where the policy gives that save 2 bits: at 4 or 8 bits the
            input's own codes are finer (measured, docs/transformers.md), so they are used there.
        min_channels: saves with fewer channels (last dimension) use MinMax: the exact channel and the
            token scales cost ``(32 + 32) / C`` bits per element in float32, 2 bits at C = 32 (an
            attention head's q, k, v), where MinMax at 4 bits costs what this codec does at 2 and
            gives a third of the LoRA gradient error (docs/transformers.md, section 1b). At least 16.
        above: split a save only where its largest channel's peak |x| is at least ``above`` times the
            median channel's (large channels present); other saves use MinMax, which costs less. 0
            splits every save the codec applies to. The default config uses 8.
    """

    fraction: float = 0.01
    axis: str = "channel"
    derivatives: bool = False
    min_channels: int = 128
    above: float = 0.0

    def __post_init__(self) -> None:
        _check_number("Outliers.above", self.above, 0, 1e6)
        object.__setattr__(self, "above", float(self.above))
        _check_number("Outliers.fraction", self.fraction, 0, 0.5)
        object.__setattr__(self, "fraction", float(self.fraction))
        if self.axis not in _AXES:
            raise ValueError(f"Outliers.axis must be one of {_AXES}, got {self.axis!r}")
        _check_bool("Outliers.derivatives", self.derivatives)
        _check_int("min_channels", self.min_channels, 16, None, owner="Outliers")


@_immutable
@dataclass(frozen=True)
class Audit:
    """The gradient audit (docs/audit.md): every ``every`` training forwards of the wrapped model, the gradient
    of a slice of the batch is taken exact and compressed and compared; below ``threshold`` the saves that
    cost most get wider codes.

    Attributes:
        every: training forwards of the wrapped model between two audits; 0 turns the audit off.
        fraction: share of the batch (first dimension) audited, in (0, 1]; at least ``min_samples``.
        min_samples: the fewest samples audited (the whole batch where it is smaller), at least 1. One
            sample's gradient is a poor judge: a MobileNetV2's was at cosine -0.46 where its batch of 8 was
            at 0.80, a T5's with large channels at 0.93 where its batch of 4 was at 0.78.
        threshold: the cosine, over all trainable parameters, of the compressed slice gradient to the exact
            one under which the audit raises widths, in [0, 1]. 0.8 catches a save planted at 1 bit (0.60
            on the test's MLP) and leaves ResNet-18's 2-bit default alone (0.82-0.86 on slices of 4-8 at
            init, a config that keeps its accuracy); 0.99 raised it to 3.5 bits on average (docs/audit.md).
        nearest_threshold: the threshold instead, where every save the slice codes is rounded to nearest
            (codes of 4 and 8 bits under ``rounding="auto"``: a transformer's defaults), in [0, 1]. Stochastic
            rounding's error is unbiased noise that steps average out, as they do the batch's own; a nearest
            code's is the same every step, a bias that accumulates. 0.99: T5 with large channels, one gradient,
            0.926 -> 0.99 at 7.3x -> 5.x (docs/audit.md). Where any save is rounded stochastically (a CNN's 2-bit
            feature maps), ``threshold`` holds: their noise alone puts a slice of 4 at 0.82-0.95.
        first: also audit the first training forward (where a bad width shows before it trains).
    """

    every: int = 50
    fraction: float = 0.125
    threshold: float = 0.8
    first: bool = True
    min_samples: int = 4
    nearest_threshold: float = 0.99

    def __post_init__(self) -> None:
        _check_int("every", self.every, 0, None, owner="Audit")
        _check_number("Audit.fraction", self.fraction, 0, 1)
        if self.fraction == 0:
            raise ValueError("Audit.fraction must be a number in (0, 1], got 0; to turn the audit off write "
                             "daf.Audit(every=0)")
        object.__setattr__(self, "fraction", float(self.fraction))
        for name in ("threshold", "nearest_threshold"):
            _check_number(f"Audit.{name}", getattr(self, name), 0, 1)
            object.__setattr__(self, name, float(getattr(self, name)))
        _check_bool("Audit.first", self.first)
        _check_int("min_samples", self.min_samples, 1, None, owner="Audit")


# The config types each typed field of Config takes, by their serialized "kind". Filled at import:
# the built-ins here, others by ``register_config_type`` (``daf.policy.register_policy`` calls it).
_KINDS: dict[str, dict[str, type]] = {
    "policy": {"auto": Auto, "uniform": Uniform, "adaptive": Adaptive},
    "codec": {"minmax": MinMax, "division": Division, "outliers": Outliers},
}


def register_config_type(field_name: str, cls: type, kind: str | None = None) -> str:
    """Let ``Config.<field_name>`` ("policy" or "codec") take instances of ``cls``, a frozen dataclass
    whose fields are plain data; returns its ``kind``, the name ``to_dict`` writes (default: the
    class name in lower case). Registering the same class again is a no-op."""
    if field_name not in _KINDS:
        raise ValueError(f"config types are registered for one of {tuple(_KINDS)}, got {field_name!r}")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise ValueError(f"a {field_name} config type must be a frozen dataclass (@dataclass(frozen=True)), "
                         f"got {cls!r}")
    kind = cls.__name__.lower() if kind is None else kind
    existing = _KINDS[field_name].get(kind)
    # a class defined again (a module reloaded, a test run twice) replaces its former self
    if existing is not None and existing is not cls and _qualified(existing) != _qualified(cls):
        raise ValueError(f"{field_name} kind {kind!r} is already taken by {_qualified(existing)}; "
                         f"pass another kind= for {_qualified(cls)}")
    _KINDS[field_name][kind] = cls
    return kind


def _qualified(cls: type) -> str:
    return f"daf.{cls.__name__}" if cls.__module__ == __name__ else f"{cls.__module__}.{cls.__qualname__}"


def _kind_of(field_name: str, cls: type) -> str | None:
    return next((kind for kind, known in _KINDS[field_name].items() if known is cls), None)


def _allowed_types(field_name: str) -> str:
    return ", ".join(f"{_qualified(cls)}(...)" if dataclasses.fields(cls) else f"{_qualified(cls)}()"
                     for cls in _KINDS[field_name].values())


def _check_typed(field_name: str, value: Any, bits: Any) -> None:
    """``value`` is an instance of a config type registered for ``field_name``; a string says what to write."""
    cls = _KINDS[field_name].get(value.strip().lower()) if isinstance(value, str) else None
    if cls is not None:
        raise ValueError(f"Config.{field_name} takes a typed config, not a string: "
                         f"{_instead_of_string(field_name, cls, bits)}")
    if _kind_of(field_name, type(value)) is None:
        registered = " (others by daf.policy.register_policy)" if field_name == "policy" else ""
        raise ValueError(f"Config.{field_name} must be one of {_allowed_types(field_name)}{registered}, "
                         f"got {value!r}")


def _instead_of_string(field_name: str, cls: type, bits: Any) -> str:
    if cls is Adaptive:
        average = float(bits) if _is_number(bits) and 1 <= bits <= 8 else 2.0
        return f"write policy=daf.Adaptive(average={average!r}) (the average lives there, not in bits)"
    if cls is Uniform:
        return "write policy=daf.Uniform() (the default; the width is Config.bits)"
    return f"write {field_name}={_qualified(cls)}()"


def _typed_to_dict(field_name: str, value: Any) -> dict[str, Any]:
    return {"kind": _kind_of(field_name, type(value)), **dataclasses.asdict(value)}


def _typed_from_dict(field_name: str, value: Any) -> Any:
    """The config a ``{"kind": ..., fields}`` dict describes; anything else is left for ``Config`` to judge."""
    if not isinstance(value, Mapping):
        return value
    data = dict(value)
    kind = data.pop("kind", None)
    cls = _KINDS[field_name].get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"Config.{field_name} in a dict needs a 'kind', one of {tuple(_KINDS[field_name])}; "
                         f"got {value!r}")
    return cls(**data)


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 dict as version 2: string policy and codec, ``bits`` the adaptive average, a top-level
    ``replan_every``."""
    data = dict(data)
    policy, replan_every = data.pop("policy", "uniform"), data.pop("replan_every", 50)
    if policy == "adaptive":
        data["policy"] = {"kind": "adaptive", "average": data.pop("bits", 2.0), "replan_every": replan_every}
    elif policy == "uniform":
        data["policy"] = {"kind": "uniform"}  # replan_every did nothing under it
    else:
        raise ValueError(f"version-1 Config.policy must be one of ('uniform', 'adaptive'), got {policy!r}")
    codec = data.pop("codec", "minmax")
    if codec not in ("minmax", "division"):
        raise ValueError(f"version-1 Config.codec must be one of ('minmax', 'division'), got {codec!r}")
    data["codec"] = {"kind": codec}
    data["version"] = CONFIG_VERSION
    return data


@_immutable
@dataclass(frozen=True)
class Config:
    """How DAF compresses the activations of one wrapped model.

    Every field is checked in ``__post_init__``; a bad value raises ``ValueError``
    naming the field, the value and what is allowed, and so does an unknown keyword.
    A ``Config`` is immutable (hashable too): ``config.replace(bits=4)`` returns a
    validated copy; assigning a field raises ``dataclasses.FrozenInstanceError``.

    Attributes:
        bits: code width per element of the ``Uniform`` policy, one of 1, 2, 4, 8; giving it asks for
            that policy (``daf.wrap(model, bits=2)``). None (the default) leaves the choice to the
            policy: ``Auto()`` (a width per save), or ``Adaptive.average``.
        group_size: elements sharing one min/scale pair; a power of two in [16, 2**20].
        rounding: "auto" (the default: stochastic for codes of 1 and 2 bits, nearest for 4 and 8),
            "stochastic" (unbiased at every width) or "nearest". Stochastic rounding keeps a coarse
            code's error unbiased, at twice nearest rounding's error variance; from 4 bits up that
            variance costs more than nearest rounding's bias of at most half a step: on 42 held-out
            models' gradients, 32 at cosine >= 0.99 under "auto" against 27 under "stochastic", and a
            higher stored ratio where fused attention's q and k are kept (docs/default.md).
        min_numel: tensors with fewer elements are kept as they are.
        seed: seed of the counter-based generator used by stochastic rounding.
        policy: ``Uniform()`` (every site gets ``bits``) or ``Adaptive(average=...)`` (bits per site
            from importance), or a type registered with ``daf.policy.register_policy``.
        codec: ``MinMax()`` (per-group min/scale), ``Division()`` (DIVISION dual precision for 4-D
            activations) or ``Outliers()`` (outlier channels exact, for transformers).
        backend: "auto" (native kernels when they build, else reference), "native" or "reference".
        budget: memory budget for stored activations, bytes or a string like "512MiB"; None for no limit.
        min_bits: the fewest bits demotion may go down to under a budget. 2 by default: demoting to
            1 bit wrecked training in the 200-step budget benchmark (docs/paging.md).
        page_size: bytes per page of the activation pool; a power of two in [4KiB, 64MiB]. Each record
            wastes half a page on average: 4KiB keeps that under 1% on ResNet-18 (docs/paging.md).
        return_pages: give the pool's freed pages back to the system at once (CPU), so that between
            steps the process does not hold them. Off by default: it does not lower the step's peak,
            and the next forward faults them in again, which on a virtual machine that reports free
            memory to its host cost 3-8% of a ResNet-18 step (docs/paging.md).
        spill_dir: parent directory for the private spill directory: an existing directory this process
            may write to, checked here; None uses the system temp dir.
        background: compress on a worker thread while forward goes on.
        masks: store exact 1-bit masks where that is all backward needs: ReLU's own saved output
            (read by its backward only as ``result <= 0`` or not) and tensors holding two values (dropout
            masks, booleans). Lossless; on by default (docs/policy.md).
        channels_last: restore the 4-D CPU activations that convolutions, batch norms and ReLUs saved in
            channels-last layout, in which PyTorch's convolution backward needs no full-size reorder
            buffers (ResNet-18: a sixth less peak memory in backward at the same step time; format-1 codes
            are decoded straight into that layout); their backward reads any layout. Other saves come back in the layout they were saved in (docs/memory.md).
        allocator: where PyTorch's CPU tensors come from once DAF is attached: "auto" (the best
            allocator found, tcmalloc first), "system" (leave the process as it is), or "tcmalloc",
            "jemalloc", "mimalloc". Process-wide by nature; the system malloc keeps freed
            temporaries' memory, so without this the process barely shrinks (docs/allocator.md).
            Tensors of 8 MiB and more then come from DAF's large blocks, whose kept memory any later
            tensor can take (no heap split between a step's tensor sizes).
        decommit: the allocator gives freed memory back to the system at once instead of keeping it
            for reuse (tcmalloc's aggressive decommit), so the process's peak follows the peak of live
            tensors: for a run that must fit under a RAM cap. Every page reused after a free is faulted
            in again, large tensors in 2 MiB huge pages where the kernel allows: ResNet-18 under a 3 GiB
            cap trains batch 2347 instead of 1694, with steps about 1.3x slower on a 2-core VM
            (docs/allocator.md). Process-wide and one-way, like the allocator;
            only tcmalloc has it (others: one warning, no effect); CPU tensors only (a device's memory
            is its own allocator's).
        audit: the gradient audit, ``Audit()`` (on: every 50 forwards and the first) or ``Audit(every=0)``
            (off); docs/audit.md.
        remakes: the remake rules in use, by name (all of ``REMAKES`` by default; ``()`` for none): which
            saves are recomputed in backward from records of the same forward instead of stored. Fewer
            rules store more and recompute less, and most remakes are more accurate than the codes they
            replace: without "head_log_probabilities" an LM's log-probabilities are stored as 4-bit codes
            of their probabilities (SmolLM2 at batch 8 x 64: 12 MiB more, x1.33 fp32's step instead of
            x1.46, first-step gradient cosine 0.885 instead of 0.980); without "attention_output" fused
            attention's output and v are stored at 8 bits (their difference is what backward takes). The
            rules and what each remakes: docs/architecture.md, "Remake rules"; their cost:
            benchmarks/remakes_step.py, docs/transformers.md section 8. Graphs that ``torch.compile``
            made remake nothing whatever this says (their saves are codes; docs/integrations.md).
        split_norm_inputs: a batch or group norm's input that the policy gives 1 or 2 bits, and whose
            output a ReLU reads (``relu(bn(x) [+ shortcut])``), stored split by that ReLU's mask: codes at
            twice the width where the mask passes the gradient, one mean per group elsewhere (about the
            bytes of the plain codes), and the next convolution's input remade from it instead of stored
            (rule "norm_block", which must be in ``remakes``). Off by default: on resnet18-fmnist's model
            it stores 18.6x instead of 12.9x at 0.69x the gradient error, but the process's peak RSS rises
            (833 against 727 MiB at batch 128) and the step is x1.4 plain codes' (docs/results.md;
            ``daf.runtime.held``). Eager only: graphs that ``torch.compile`` made store plain codes.
        floors: the fewest bits for what named torch functions save, above whatever the policy gives:
            ``{"layer_norm": 4, "scaled_dot_product_attention": 4}`` (names as ``torch.nn.functional``
            spells them; the site's op in ``daf.report``). Kept as sorted ``(name, bits)`` pairs; a
            policy's 0 (keep raw) stays raw. Where a LayerNorm's output is derived from its input
            (a LoRA adapter reading it), ``layer_norm``'s floor sets the precision of both. They act
            where DAF's op tracker names the saving function (eager forward, the frameworks' calls);
            a save it does not see gets the policy's bits.
    """

    bits: int | None = None
    group_size: int = 256
    rounding: str = "auto"
    min_numel: int = 4096
    seed: int = 0
    policy: Auto | Uniform | Adaptive = Auto()
    codec: MinMax | Division | Outliers = Outliers(above=8.0, min_channels=32)
    backend: str = "auto"
    budget: int | str | None = None
    min_bits: int = 2
    page_size: int = 4096
    return_pages: bool = False
    spill_dir: str | None = None
    background: bool = False
    masks: bool = True
    channels_last: bool = True
    allocator: str = "auto"
    decommit: bool = False
    floors: tuple[tuple[str, int], ...] = ()
    remakes: tuple[str, ...] = REMAKES
    split_norm_inputs: bool = False
    audit: Audit = field(default_factory=Audit)
    version: int = field(default=CONFIG_VERSION, repr=False)

    def __post_init__(self) -> None:
        _check_typed("policy", self.policy, self.bits)
        _check_typed("codec", self.codec, self.bits)
        self._check_bits()
        _check_int("group_size", self.group_size, 16, 2**20)
        if not _is_power_of_two(self.group_size):
            raise ValueError(f"Config.group_size must be a power of two in [16, 1048576], got {self.group_size}")
        _check_choice("rounding", self.rounding, ROUNDINGS)
        _check_int("min_numel", self.min_numel, 0, None)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_choice("backend", self.backend, _BACKENDS)
        object.__setattr__(self, "budget", parse_size(self.budget, "budget"))
        _check_choice("min_bits", self.min_bits, ALLOWED_BITS)
        self._check_min_bits_within_bits()
        _check_int("page_size", self.page_size, 4096, 64 * 2**20)
        if not _is_power_of_two(self.page_size):
            raise ValueError(f"Config.page_size must be a power of two in [4096, 67108864], got {self.page_size}")
        _check_bool("Config.return_pages", self.return_pages)
        _check_spill_dir(self.spill_dir)
        _check_bool("Config.background", self.background)
        _check_bool("Config.masks", self.masks)
        _check_bool("Config.channels_last", self.channels_last)
        _check_choice("allocator", self.allocator, _ALLOCATORS)
        _check_bool("Config.decommit", self.decommit)
        object.__setattr__(self, "floors", _checked_floors(self.floors))
        object.__setattr__(self, "remakes", _checked_remakes(self.remakes))
        _check_bool("Config.split_norm_inputs", self.split_norm_inputs)
        self._check_split_norm_inputs()
        if not isinstance(self.audit, Audit):
            raise ValueError(f"Config.audit must be a daf.Audit(...) (daf.Audit(every=0) turns it off), "
                             f"got {self.audit!r}")
        if self.version != CONFIG_VERSION:
            raise ValueError(f"Config.version {self.version} is not supported; this DAF makes version "
                             f"{CONFIG_VERSION} (Config.from_dict reads version-1 dicts too)")

    def _check_split_norm_inputs(self) -> None:
        """The split needs the block remake and MinMax or Outliers codes: without them it would do nothing."""
        if not self.split_norm_inputs:
            return
        if "norm_block" not in self.remakes:
            raise ValueError(f"Config.split_norm_inputs=True needs the remake rule 'norm_block' in Config.remakes "
                             f"(the conv input is remade from the split record); got remakes={self.remakes!r}")
        if not isinstance(self.codec, (MinMax, Outliers)):
            raise ValueError(f"Config.split_norm_inputs=True splits MinMax or Outliers codes; codec={self.codec!r} "
                             f"keeps its own form: drop one of the two")

    def _check_bits(self) -> None:
        """``bits`` is a width; an average belongs to ``Adaptive``, which says so when it is asked for. A width
        given with the default ``Auto`` policy asks for uniform bits; without one, ``Uniform`` takes 2."""
        bits = self.bits
        if bits is None:
            object.__setattr__(self, "bits", None if isinstance(self.policy, (Auto, Adaptive)) else UNIFORM_BITS)
            return
        if isinstance(self.policy, Auto):
            object.__setattr__(self, "policy", Uniform())
        if not (_is_number(bits) and bits in ALLOWED_BITS):
            hint = ""
            if _is_number(bits) and 1 <= bits <= 8:
                hint = f"; for an average of {bits:g} bits per element write policy=daf.Adaptive(average={float(bits)!r})"
            raise ValueError(f"Config.bits must be one of {ALLOWED_BITS} (the code width of the Uniform policy), "
                             f"got {bits!r}{hint}")
        object.__setattr__(self, "bits", int(bits))
        if isinstance(self.policy, Adaptive) and self.bits != UNIFORM_BITS:  # 2: what configs of version 2 wrote
            raise ValueError(f"Config.bits={self.bits} is the width of the Uniform policy and does nothing with "
                             f"policy=daf.Adaptive(...), whose average is Adaptive.average: write "
                             f"policy=daf.Adaptive(average={float(self.bits)!r}) and leave bits out")

    def _check_min_bits_within_bits(self) -> None:
        """Demotion goes down to ``min_bits`` from the width records are stored at: a floor above the Uniform
        policy's ``bits`` would never be reached, and says the caller meant something else. The default floor
        (2) stays allowed under ``bits=1``, which it has always accompanied."""
        if not isinstance(self.policy, Uniform):  # widths per save: some are 8
            return
        most = max(self.bits, Config.__dataclass_fields__["min_bits"].default)
        if self.min_bits > most:
            raise ValueError(f"Config.min_bits={self.min_bits} is above Config.bits={self.bits}: min_bits is the "
                             f"fewest bits demotion under a budget may go down to, so it must be one of "
                             f"{tuple(b for b in ALLOWED_BITS if b <= most)} (at most bits)")

    def floor_for(self, op_name: str | None) -> int:
        """The fewest bits ``floors`` allows for a save of ``op_name`` (1 where none is named)."""
        return next((bits for name, bits in self.floors if name == op_name), 1)

    def replace(self, **overrides: Any) -> "Config":
        """A validated copy with some fields changed; unknown names raise ``ValueError``."""
        _check_field_names(Config, overrides)
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with a version, for JSON; ``Config.from_dict`` reads it back.

        >>> Config(policy=Adaptive(average=1.5)).to_dict()["policy"]["kind"]
        'adaptive'
        """
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["floors"] = dict(self.floors)
        data["remakes"] = list(self.remakes)
        for name in _KINDS:
            data[name] = _typed_to_dict(name, data[name])
        data["audit"] = dataclasses.asdict(self.audit)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        """The config ``to_dict`` wrote, of this version or version 1 (migrated); missing fields take
        their defaults, and so do missing fields of a typed config.

        >>> Config.from_dict({"version": 1, "policy": "adaptive", "bits": 1.5}).policy.average
        1.5
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"Config.from_dict takes a dict, got {type(data).__name__}")
        data = dict(data)
        if data.get("version", CONFIG_VERSION) == 1:
            data = _migrate_v1(data)
        for name in _KINDS:
            if name in data:
                data[name] = _typed_from_dict(name, data[name])
        if isinstance(data.get("audit"), Mapping):  # a dict without it (written before the audit) takes the default
            data["audit"] = Audit(**data["audit"])
        return cls().replace(**data)


def parse_remakes(text: str) -> tuple[str, ...]:
    """``Config.remakes`` from the command line's form: rule names separated by commas, or "none".

    >>> parse_remakes("norm_block, activation"), parse_remakes("none")
    (('activation', 'norm_block'), ())
    """
    names = () if text.strip() == "none" else tuple(name.strip() for name in text.split(","))
    return _checked_remakes(names)


def _checked_remakes(value: Any) -> tuple[str, ...]:
    """``remakes`` as rule names in ``REMAKES``' order, from any sequence of distinct names."""
    allowed = f"a sequence of names from {REMAKES} (each once; () for none)"
    if isinstance(value, str) or not isinstance(value, (tuple, list, set, frozenset)):
        raise ValueError(f"Config.remakes must be {allowed}; got {value!r}")
    names = list(value)
    unknown = [name for name in names if name not in REMAKES]
    if unknown:
        raise ValueError(f"Config.remakes: no remake rule named {', '.join(map(repr, unknown))}; it must be {allowed}")
    if len(set(names)) != len(names):
        raise ValueError(f"Config.remakes names each rule once; got {value!r}")
    return tuple(name for name in REMAKES if name in names)


def _checked_floors(value: Any) -> tuple[tuple[str, int], ...]:
    """``floors`` as sorted (name, bits) pairs, from a mapping or pairs; one entry per name."""
    allowed = (f"a mapping from torch function names to bits in {ALLOWED_BITS}, e.g. "
               f"{{'layer_norm': 4}}")
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(pair) for pair in value]
    except TypeError:
        raise ValueError(f"Config.floors must be {allowed}; got {value!r}") from None
    names = [pair[0] if len(pair) == 2 else None for pair in pairs]
    for pair, name in zip(pairs, names):
        if len(pair) != 2 or not isinstance(name, str) or not name.strip() \
                or isinstance(pair[1], bool) or pair[1] not in ALLOWED_BITS:
            raise ValueError(f"Config.floors must be {allowed}; got {value!r} (entry {pair!r})")
    if len(set(names)) != len(names):
        raise ValueError(f"Config.floors names each function once; got {value!r}")
    for name in names:
        _check_torch_function(name, value)
    return tuple(sorted((name, int(bits)) for name, bits in pairs))


def _check_torch_function(name: str, floors: Any) -> None:
    """A floor names a function of ``torch.nn.functional``, ``torch`` or ``torch.Tensor``: a misspelt name
    would match no save and silently do nothing."""
    import torch
    spaces = (torch.nn.functional, torch, torch.Tensor)
    if any(callable(getattr(space, name, None)) for space in spaces):
        return
    close = difflib.get_close_matches(name, [n for n in dir(torch.nn.functional) if not n.startswith("_")], 1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"Config.floors: {name!r} is no function of torch.nn.functional, torch or torch.Tensor{hint}; "
                     f"floors name the torch function that saves, as daf.report's ops show it; got {floors!r}")








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
