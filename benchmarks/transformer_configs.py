"""The configs compared by ``transformer_archs.py`` and ``transformer_gradients.py``, by name.

``outliers-*``: ``daf.config.Outliers()`` (1% of channels exact, axis "channel"); ``-token``: axis
"token"; ``-derivatives``: GELU/SiLU inputs as 2-bit derivative codes (at 2 bits only);
``-f0.005`` / ``-f0.03``: the share of channels kept exact. ``adaptive-floor-2.0`` /
``adaptive-trade-2.0``: the adaptive policy with its generic-model sites never cut / traded like the
others (``AdaptivePolicy.generic``; ``adaptive-2.0`` holds them at the uniform width).
"""

from __future__ import annotations

from dataclasses import dataclass

import daf
from daf.config import Outliers
from daf.policy import AdaptivePolicy, register_policy

__all__ = ["CONFIGS", "AdaptiveGeneric"]


@dataclass(frozen=True)
class AdaptiveGeneric:
    """``daf.Adaptive`` with ``AdaptivePolicy.generic`` chosen: "hold" (the default), "floor" or "trade"
    (the plans before issue 16): what the policy does with the sites its generic model costs."""

    average: float = 2.0
    generic: str = "floor"
    replan_every: int = 50
    window: int = 4


@register_policy(AdaptiveGeneric, kind="adaptive-generic")
def _adaptive_generic(config: daf.Config) -> AdaptivePolicy:
    p = config.policy
    return AdaptivePolicy(p.average, config.group_size, p.replan_every, window=p.window, generic=p.generic)


_ADAPTIVE = daf.Adaptive(average=2.0)

CONFIGS: dict[str, daf.Config] = {
    "uniform-2": daf.Config(bits=2),
    "uniform-4": daf.Config(bits=4),
    "uniform-8": daf.Config(bits=8),
    "adaptive-2.0": daf.Config(policy=_ADAPTIVE),
    "outliers-2": daf.Config(bits=2, codec=Outliers()),
    "outliers-token-2": daf.Config(bits=2, codec=Outliers(axis="token")),
    "outliers-none-2": daf.Config(bits=2, codec=Outliers(fraction=0.0)),
    "outliers-f0.005-2": daf.Config(bits=2, codec=Outliers(fraction=0.005)),
    "outliers-f0.03-2": daf.Config(bits=2, codec=Outliers(fraction=0.03)),
    "outliers-derivatives-2": daf.Config(bits=2, codec=Outliers(derivatives=True)),
    "derivatives-2": daf.Config(bits=2, codec=Outliers(axis="token", fraction=0.0, derivatives=True)),
    "adaptive-floor-2.0": daf.Config(policy=AdaptiveGeneric(generic="floor")),
    "adaptive-trade-2.0": daf.Config(policy=AdaptiveGeneric(generic="trade")),
    "outliers-adaptive-2.0": daf.Config(policy=_ADAPTIVE, codec=Outliers()),
    "outliers-derivatives-adaptive-2.0": daf.Config(policy=_ADAPTIVE, codec=Outliers(derivatives=True)),
    "outliers-4": daf.Config(bits=4, codec=Outliers()),
    "outliers-adaptive-4.0": daf.Config(policy=daf.Adaptive(average=4.0), codec=Outliers()),
    "outliers-adaptive-3.0": daf.Config(policy=daf.Adaptive(average=3.0), codec=Outliers()),
    "outliers-adaptive-3.5": daf.Config(policy=daf.Adaptive(average=3.5), codec=Outliers()),
    "outliers-adaptive-3.75": daf.Config(policy=daf.Adaptive(average=3.75), codec=Outliers()),
    "outliers-token-4": daf.Config(bits=4, codec=Outliers(axis="token")),
}
