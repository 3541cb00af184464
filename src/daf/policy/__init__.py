"""Bit policies: how many bits each saved activation gets."""

from daf.config import Config
from daf.policy.uniform import Policy, UniformPolicy

__all__ = ["Policy", "UniformPolicy", "make_policy"]


def make_policy(config: Config) -> Policy:
    """The policy ``config.policy`` names."""
    if config.policy == "uniform":
        return UniformPolicy(int(config.bits))
    raise NotImplementedError(f"policy {config.policy!r} is not implemented yet; use policy='uniform'")
