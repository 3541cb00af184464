"""The configs compared by ``transformer_archs.py`` and ``transformer_gradients.py``, by name.

``outliers-*``: ``daf.config.Outliers()`` (1% of channels exact, axis "channel"); ``-token``: axis
"token"; ``-derivatives``: GELU/SiLU inputs as 2-bit derivative codes (at 2 bits only);
``-f0.005`` / ``-f0.03``: the share of channels kept exact.
"""

from __future__ import annotations

import daf
from daf.config import Outliers

__all__ = ["CONFIGS"]

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
    "outliers-adaptive-2.0": daf.Config(policy=_ADAPTIVE, codec=Outliers()),
    "outliers-derivatives-adaptive-2.0": daf.Config(policy=_ADAPTIVE, codec=Outliers(derivatives=True)),
    "outliers-4": daf.Config(bits=4, codec=Outliers()),
    "outliers-token-4": daf.Config(bits=4, codec=Outliers(axis="token")),
}
