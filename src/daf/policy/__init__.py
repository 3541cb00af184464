"""Bit policies: how many bits each saved activation gets.

Each policy config type (``Config.policy``) has a factory registered for it, which builds the
``Policy`` a session asks. ``register_policy`` is public: a user, a test or a benchmark can bring
its own config type and policy.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Everywhere8:
...     pass
>>> @register_policy(Everywhere8)
... def _everywhere8(config: Config) -> Policy:
...     return UniformPolicy(8)
>>> make_policy(Config(policy=Everywhere8())).bits
8
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from daf.config import Adaptive, Auto, Config, Uniform, register_config_type
from daf.policy.adaptive import AdaptivePolicy
from daf.policy.allocator import Plan, Site, allocate
from daf.policy.auto import AutoPolicy
from daf.policy.uniform import Policy, UniformPolicy

__all__ = ["Policy", "AutoPolicy", "UniformPolicy", "AdaptivePolicy", "make_policy", "register_policy", "allocate", "Site",
           "Plan"]

PolicyFactory = Callable[[Config], Policy]
_Factory = TypeVar("_Factory", bound=PolicyFactory)

# Policy config type -> its factory. Filled at import by ``register_policy`` (the built-ins below).
_FACTORIES: dict[type, PolicyFactory] = {}


def register_policy(config_type: type, kind: str | None = None) -> Callable[[_Factory], _Factory]:
    """Decorator: ``factory(config) -> Policy`` builds the policy of every ``Config`` whose ``policy``
    is a ``config_type`` (a frozen dataclass of plain data). ``Config`` then accepts that type, and
    ``Config.to_dict`` writes it as ``{"kind": kind, fields...}`` (``kind`` defaults to the class
    name in lower case). Registering a type again replaces its factory."""
    def register(factory: _Factory) -> _Factory:
        register_config_type("policy", config_type, kind)
        _FACTORIES[config_type] = factory
        return factory
    return register


def make_policy(config: Config) -> Policy:
    """The policy for ``config.policy``, by the factory registered for its type.

    >>> make_policy(Config(policy=Adaptive(average=1.5))).default_bits
    2
    """
    factory = _FACTORIES.get(type(config.policy))
    if factory is None:
        name = type(config.policy).__name__
        raise ValueError(f"no policy is registered for Config.policy of type {name}; register a factory with "
                         f"@daf.policy.register_policy({name}), or use daf.Uniform() or daf.Adaptive(...)")
    return factory(config)


@register_policy(Auto)
def _auto(config: Config) -> Policy:
    return AutoPolicy(config.policy)


@register_policy(Uniform)
def _uniform(config: Config) -> Policy:
    return UniformPolicy(config.bits)


@register_policy(Adaptive)
def _adaptive(config: Config) -> Policy:
    return AdaptivePolicy(group_size=config.group_size, **dataclasses.asdict(config.policy))
