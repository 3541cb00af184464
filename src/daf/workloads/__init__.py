"""Real training workloads, each loadable by name: ``get_workload("resnet18-fmnist")``.

>>> names()
('resnet18-fmnist', 'minilm-tweets', 'smollm-lora', 'tiny-mnist')
>>> get_workload("tiny-mnist", train_size=64).default_batch
64

Workload modules are imported on first use, so importing this package stays light
(``transformers`` is imported only by the text workloads, when they load).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from daf.workloads.base import Batch, Workload
from daf.workloads.packages import MissingPackage

__all__ = ["get_workload", "names", "workload_class", "Workload", "Batch", "MissingPackage"]

# name -> (module, class); read-only.
_REGISTRY = MappingProxyType({
    "resnet18-fmnist": ("daf.workloads.resnet18_fmnist", "ResNet18FashionMNIST"),
    "minilm-tweets": ("daf.workloads.minilm_tweets", "MiniLMTweets"),
    "smollm-lora": ("daf.workloads.smollm_lora", "SmolLMLoRA"),
    "tiny-mnist": ("daf.workloads.tiny_mnist", "TinyMNIST"),
})


def names() -> tuple[str, ...]:
    """The registered workload names."""
    return tuple(_REGISTRY)


def workload_class(name: str) -> type[Workload]:
    """The class registered under ``name``; ``ValueError`` naming the allowed names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown workload {name!r}; allowed: {', '.join(names())}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def get_workload(name: str, **options: Any) -> Workload:
    """A new ``Workload`` named ``name`` built with ``options`` (``seed``, ``train_size``, ``eval_size`` and
    the workload's own, e.g. ``width`` for ``resnet18-fmnist``). Loads no data until asked.

    An unknown option raises ``ValueError`` listing the workload's options.
    """
    cls = workload_class(name)
    try:
        return cls(**options)
    except TypeError as error:
        import inspect
        allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ValueError(f"workload {name!r} does not take options {sorted(options)}: {error}; "
                         f"allowed options: {', '.join(allowed)}") from None
