"""The memory format a restored activation comes back in.

A restored tensor is a new tensor, so DAF may give it the layout backward runs best on. PyTorch's CPU
convolution backward (oneDNN) on NCHW tensors reorders its gradient and input into blocked buffers of
their full size: at 64 channels x 28 x 28, three full-size tensors alive inside one call against one
for channels-last (NHWC) tensors, and 7% less CPU time in ResNet-18's convolution backward
(docs/memory.md). Channels-last inputs make the gradients channels-last too, so batch norm and ReLU
backward, which are fast only when their input and gradient agree, get theirs restored channels-last as
well. The rule is kept to these ops, whose backward is PyTorch's own and reads any layout: a custom
``autograd.Function`` that saves a tensor gets it back in the layout it saved (its backward may
``view`` it). This module decides; the codecs decode in that layout (``Codecs.decode``: format-1 codes
straight into it, other records through ``daf.kernels.layout_ops.to_channels_last``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from daf.tracing import OpCall

__all__ = ["CHANNELS_LAST_FUNCTIONS", "reads_any_layout", "restores_channels_last", "restores_raw_channels_last"]


def _channels_last_functions() -> frozenset:
    from daf.tracing.ops import RELU_FUNCTIONS
    return frozenset({F.conv2d, torch.conv2d, F.batch_norm, torch.batch_norm}) | RELU_FUNCTIONS


CHANNELS_LAST_FUNCTIONS = _channels_last_functions()


def reads_any_layout(op: OpCall | None) -> bool:
    """Whether ``op``'s backward is PyTorch's own for a convolution, batch norm or ReLU (``CHANNELS_LAST_FUNCTIONS``)."""
    return op is not None and op.func in CHANNELS_LAST_FUNCTIONS


def restores_channels_last(tensor: torch.Tensor, op: OpCall | None, enabled: bool) -> bool:
    """Whether ``tensor``, saved by ``op``, is restored channels-last: a 4-D CPU tensor not in that layout
    already, saved by an op whose backward reads any layout (``reads_any_layout``)."""
    return _restorable(tensor, op, enabled) and not tensor.is_contiguous(memory_format=torch.channels_last)


def _restorable(tensor: torch.Tensor, op: OpCall | None, enabled: bool) -> bool:
    """A 4-D CPU tensor saved by an op whose backward reads any layout, with the restore turned on."""
    return enabled and reads_any_layout(op) and tensor.dim() == 4 and tensor.device.type == "cpu"


def restores_raw_channels_last(tensor: torch.Tensor, op: OpCall | None, enabled: bool) -> bool:
    """Whether ``tensor``, kept raw (the input batch of a network's first convolution), is handed to
    ``op``'s backward as a channels-last copy: as for a restored save, and also when it is channels-last
    only by its size-1 dimensions (a one-channel image batch), which PyTorch's convolution reads as
    NCHW and answers by copying the channels-last gradient into NCHW. The copy costs the input's size
    (a few channels), the NCHW gradient would cost the output's."""
    return _restorable(tensor, op, enabled) and tensor.stride() != _channels_last_strides(tensor.shape)


def _channels_last_strides(shape: torch.Size) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)
