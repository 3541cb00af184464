"""The ways to train that ``daf bench memory`` compares, and how each is applied to a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from daf.config import Adaptive, Config, Outliers

__all__ = ["Method", "methods_for", "workload_config", "checkpoint_blocks", "WORKLOAD_BITS", "CONVOLUTIONAL"]

# The bits that keep each workload's result (docs/results.md): SmolLM2 needs 4 with the Outliers codec
# (8 with MinMax codes), and no adaptive plan keeps its loss (+1.73% at an average of 4.0); MiniLM
# keeps its accuracy at 2 bits with Outliers, GELU derivative codes and 4-bit floors under its norms,
# attention and linears (2-bit MinMax codes lose 4.5 points).
WORKLOAD_BITS = {"resnet18-fmnist": 2, "minilm-tweets": 2, "smollm-lora": 4, "tiny-mnist": 2}
_CODECS = {"smollm-lora": Outliers(), "minilm-tweets": Outliers(derivatives=True)}
_FLOORS = {"minilm-tweets": {"layer_norm": 4, "scaled_dot_product_attention": 4, "linear": 4}}
_NO_ADAPTIVE = frozenset({"smollm-lora"})


def workload_config(workload: str) -> Config:
    """DAF's uniform config for ``workload`` at the bits, codec and floors that keep its result."""
    config = Config(bits=WORKLOAD_BITS.get(workload, 2))
    if workload in _CODECS:
        config = config.replace(codec=_CODECS[workload])
    return config.replace(floors=_FLOORS[workload]) if workload in _FLOORS else config


# Workloads of 4-D feature maps, where the channels-last restore (Config.channels_last) applies.
CONVOLUTIONAL = frozenset({"resnet18-fmnist", "tiny-mnist"})


@dataclass(frozen=True)
class Method:
    """One way to train: DAF's config (None: no DAF; its allocator is replaced by ``allocator``),
    per-block recomputation, ``torch.compile`` (with a recomputation budget or not), and the allocator
    ("system": as a plain PyTorch user runs; "auto": DAF's, installed in-process before anything
    is allocated), which with ``decommit`` gives freed memory back at once (``Config.decommit``)."""

    name: str
    daf: Config | None = None
    checkpoint: bool = False
    compile: bool = False
    compile_budget: float | None = None  # torch._functorch.config.activation_memory_budget; None: compile's own
    allocator: str = "auto"
    decommit: bool = False
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        daf = None if self.daf is None else self.daf.to_dict()
        return {"name": self.name, "daf": daf, "checkpoint": self.checkpoint, "compile": self.compile,
                "compile_budget": self.compile_budget, "allocator": self.allocator, "decommit": self.decommit,
                "notes": self.notes}


def methods_for(workload: str, cap_bytes: int, quick: bool = False) -> list[Method]:
    """Every method, with the workload's bits; ``quick`` keeps three."""
    uniform = workload_config(workload)
    bits = uniform.bits
    listed = [
        Method("fp32 (system malloc)", allocator="system", notes="plain PyTorch, as a user runs it"),
        Method("fp32", notes="plain PyTorch on DAF's allocator"),
        Method("checkpoint", checkpoint=True, notes="torch.utils.checkpoint per block, non-reentrant"),
        Method("compile", compile=True, notes="torch.compile(model), inductor's defaults"),
        Method("compile budget 0.5", compile=True, compile_budget=0.5,
               notes="torch.compile, torch._functorch.config.activation_memory_budget = 0.5"),
        Method(f"DAF {bits}-bit", daf=uniform),
        Method(f"DAF {bits}-bit compiled", daf=uniform, compile=True,
               notes="torch.compile(daf.wrap(model)): codes inside the graphs (docs/integrations.md)"),
        *([Method(f"DAF {bits}-bit channels-last", daf=uniform.replace(channels_last=True),
                  notes="restored conv/BN/ReLU inputs channels-last (--layout channels-last)")]
          if workload in CONVOLUTIONAL and not uniform.channels_last else []),
        Method(f"DAF adaptive {bits:.1f}", daf=Config(policy=Adaptive(average=float(bits)))),
        Method(f"DAF {bits}-bit + checkpoint", daf=uniform, checkpoint=True),
        Method(f"DAF {bits}-bit budget", daf=uniform.replace(budget=cap_bytes // 8),
               notes=f"stored activations capped at 1/8 of the RAM cap ({cap_bytes // 8 >> 20} MiB); the rest spills"),
        Method("fp32 decommit", decommit=True, notes="plain PyTorch on DAF's allocator, freed memory given back at once"),
        Method(f"DAF {bits}-bit decommit", daf=uniform.replace(decommit=True), decommit=True,
               notes="Config.decommit: freed memory given back at once (page faults for memory)"),
    ]
    if bits == 8 or workload in _NO_ADAPTIVE:  # an adaptive average of 8 is uniform 8
        listed = [m for m in listed if not m.name.startswith("DAF adaptive")]
    if quick:
        keep = {"fp32 (system malloc)", "fp32", f"DAF {bits}-bit"}
        listed = [m for m in listed if m.name in keep]
    return listed


def _block_lists(model: nn.Module) -> list[nn.Module]:
    """The blocks to recompute: the children of every ModuleList/Sequential whose children are all
    composite modules (ResNet's BasicBlocks, a transformer's layers), outermost first, not nested."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if children and all(any(True for _ in child.children()) for child in children):
            blocks.extend(children)
            for child in children:
                inside.update(id(m) for m in child.modules())
    return blocks


def checkpoint_blocks(model: nn.Module) -> int:
    """Make each block recompute its forward in backward (non-reentrant checkpointing); returns how
    many blocks. Only the blocks' inputs are saved for backward."""
    from torch.utils.checkpoint import checkpoint

    blocks = _block_lists(model)
    for block in blocks:
        forward = block.forward

        def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = recomputed
    return len(blocks)
