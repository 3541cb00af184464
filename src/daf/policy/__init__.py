"""Bit policies: how many bits each saved activation gets."""

from daf.config import Config
from daf.policy.adaptive import AdaptivePolicy
from daf.policy.allocator import Plan, Site, allocate
from daf.policy.uniform import Policy, UniformPolicy

__all__ = ["Policy", "UniformPolicy", "AdaptivePolicy", "make_policy", "allocate", "Site", "Plan"]


def make_policy(config: Config) -> Policy:
    """The policy ``config.policy`` names: "uniform" (``config.bits`` everywhere) or "adaptive".

    >>> make_policy(Config(policy="adaptive", bits=1.5)).default_bits
    2
    """
    if config.policy == "uniform":
        return UniformPolicy(int(config.bits))
    if config.policy == "adaptive":
        return AdaptivePolicy(float(config.bits), config.group_size, config.replan_every)
    raise ValueError(f"Config.policy must be 'uniform' or 'adaptive', got {config.policy!r}")
