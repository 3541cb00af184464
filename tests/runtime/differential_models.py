"""Random small models for the differential test (``tests/runtime/test_differential.py``).

A model is described by a ``ModelSpec``: the batch shape ``(batch, height * width, channels)``, a
dtype, and a list of blocks, each a plain tuple such as ``("linear", True)`` or
``("attention", 2, "sdpa", True, 0.0, True, "default")``, so that hypothesis prints a failing model in a form that can
be pasted back into ``build``. Every block maps a ``(B, T, C)`` tensor to one of the same shape; the
convolutions see it as ``(B, C, T)`` or ``(B, C, H, W)``, the attention as ``(B, heads, T, C / heads)``.

Blocks (the fields after the name):

- ``("linear", bias)``, ``("mlp", hidden_multiple, activation, bias)``
- ``("act", activation)``: relu, relu_inplace, gelu, gelu_tanh, silu, tanh, sigmoid, softmax
- ``("norm", kind, groups)``: layer, batch1d, batch2d, group (``groups`` divides C)
- ``("conv1d", kernel, depthwise, bias)``, ``("conv2d", kernel, channels_last, bias)``
- ``("attention", heads, impl, causal, dropout_p, qk_norm, scale)``: impl "sdpa"
  (``F.scaled_dot_product_attention``) or "eager" (``softmax(q k^T * scale) v``); ``qk_norm``
  normalizes q and k (``F.layer_norm`` without weights, as QK-norm models do), which bounds the logits;
  ``scale`` is "default" (1 / sqrt(d)) or "small" (1 / d)
- ``("residual", how, inner)``: ``h + f(h)`` with ``inner`` a list of blocks; ``how`` is "add",
  "add_" (``f(h).add_(h)``) or "iadd" (``h.add_(f(h))``, which plain autograd refuses when f saved h)
- ``("inplace", op, target)``: op in add, mul, relu_, sigmoid_, tanh_, mul_param, add_param on the
  whole tensor or on a view of it (target: whole, slice, transpose, strided)
- ``("view", kind, activation)``: the activation applied through a view: "heads" (view + permute),
  "transpose" (and the result left non-contiguous), "slice" (``cat`` of a slice and the rest),
  "strided" (every other channel)
- ``("dropout", p, mode)``: mode "module" (``nn.Dropout``), "module_eval" (an ``nn.Dropout`` in eval
  mode inside the training model), "functional", "inplace"
- ``("masked_attention", heads, kind)``, ``("edit_logits",)``: held masks changed outside autograd and
  logits edited under no_grad (issue 42; ``MaskedAttention``, ``EditLogits``)
- ``("square",)``: ``h * h`` (one tensor saved twice by one op) over its largest value,
  ``("gate",)``: ``h * sigmoid(h)`` written out, ``("pool",)``: ``max_pool1d`` over T, stride 1
  (saves int64 indices)

``ModelSpec.mutate`` adds an in-place change after forward and before backward (``Net.mutate``): to the
input, or to a block's output through the tensor itself (kept, or "dropped" after the change), a view of
it or a detached alias; ``("mask", how)`` rewrites every ``MaskedAttention``'s mask.

Dropout draws from torch's global generator: the test seeds it identically before each run, and DAF
draws nothing from it (stochastic rounding has its own counter-based generator), so both runs drop the
same elements; the test checks that the forward outputs are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "ModelSpec", "Net", "build", "activation"]

ACTIVATIONS = ("relu", "relu_inplace", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "softmax")


def activation(name: str, h: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return F.relu(h)
    if name == "relu_inplace":
        return F.relu(h, inplace=True)
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "silu":
        return F.silu(h)
    if name == "tanh":
        return torch.tanh(h)
    if name == "sigmoid":
        return torch.sigmoid(h)
    if name == "softmax":
        return torch.softmax(h, dim=-1)
    raise ValueError(f"unknown activation {name!r}")


@dataclass(frozen=True)
class ModelSpec:
    """What ``build`` makes: shapes, dtype, blocks, the input's scale and the head."""

    batch: int
    height: int
    width: int
    channels: int
    dtype: str  # "float32", "float64", "bfloat16", "float16"
    blocks: tuple = ()
    input_scale: float = 1.0
    head: str = "project"  # "project": (out * fixed random weights).sum(); "cross_entropy": over C classes
    seed: int = 0
    mutate: tuple | None = None  # after forward, before backward: (block index or "input", how), see Net.mutate

    @property
    def tokens(self) -> int:
        return self.height * self.width

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class _Block(nn.Module):
    def __init__(self, spec: tuple, c: int, h: int, w: int) -> None:
        super().__init__()
        self.spec, self.c, self.hh, self.ww = spec, c, h, w


class Linear(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        self.lin = nn.Linear(c, c, bias=spec[1])

    def forward(self, x):
        return self.lin(x)


class MLP(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, multiple, self.act, bias = spec
        self.fc1 = nn.Linear(c, multiple * c, bias=bias)
        self.fc2 = nn.Linear(multiple * c, c, bias=bias)

    def forward(self, x):
        return self.fc2(activation(self.act, self.fc1(x)))


class Act(_Block):
    def forward(self, x):
        return activation(self.spec[1], x)


class Norm(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, self.kind, groups = spec
        self.norm = {"layer": lambda: nn.LayerNorm(c), "batch1d": lambda: nn.BatchNorm1d(c),
                     "batch2d": lambda: nn.BatchNorm2d(c), "group": lambda: nn.GroupNorm(groups, c)}[self.kind]()

    def forward(self, x):
        if self.kind == "layer":
            return self.norm(x)
        b, t, c = x.shape
        if self.kind == "batch2d":
            return self.norm(x.transpose(1, 2).reshape(b, c, self.hh, self.ww)).reshape(b, c, t).transpose(1, 2)
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


class Conv1d(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, kernel, depthwise, bias = spec
        self.conv = nn.Conv1d(c, c, kernel, padding=kernel // 2, groups=c if depthwise else 1, bias=bias)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class Conv2d(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, kernel, self.channels_last, bias = spec
        self.conv = nn.Conv2d(c, c, kernel, padding=kernel // 2, bias=bias)
        if self.channels_last:
            self.conv.to(memory_format=torch.channels_last)

    def forward(self, x):
        b, t, c = x.shape
        image = x.transpose(1, 2).reshape(b, c, self.hh, self.ww)
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        return self.conv(image).flatten(2).transpose(1, 2)


class Attention(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, self.heads, self.impl, self.causal, self.dropout_p, self.qk_norm, self.scale = spec
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        if self.qk_norm:
            q, k = F.layer_norm(q, (d,)), F.layer_norm(k, (d,))
        scale = 1 / math.sqrt(d) if self.scale == "default" else 1 / d
        if self.impl == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=self.causal, scale=scale)
        else:
            scores = (q @ k.transpose(-1, -2)) * scale
            if self.causal:
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(mask, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            if self.dropout_p:
                weights = F.dropout(weights, self.dropout_p, training=True)
            o = weights @ v
        return self.proj(o.transpose(1, 2).reshape(b, t, c))


class MaskedAttention(_Block):
    """``("masked_attention", heads, kind)``: the math path of ``F.scaled_dot_product_attention`` (dropout
    on) with a padding mask the model holds outside autograd: kind "bool_numpy" or "float_numpy"
    (``torch.from_numpy`` over a buffer a loader would reuse) or "float_tensor". ``change(how)`` rewrites
    it for the next batch after forward: "rewrite" (the numpy buffer; no version change), "data"
    (through ``.data``; none either), "in_place" (``copy_``: a version change)."""

    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, self.heads, self.kind = spec
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.buffer = self._pattern(0)
        self.mask = torch.from_numpy(self.buffer) if self.kind.endswith("numpy") else torch.tensor(self.buffer)

    def _pattern(self, seed: int) -> np.ndarray:
        t = self.hh * self.ww
        kept = np.random.default_rng(seed).random((1, 1, t, t)) > 0.4
        kept |= np.eye(t, dtype=bool)  # every query attends somewhere
        return kept if self.kind == "bool_numpy" else np.where(kept, 0.0, -4.0).astype(np.float32)

    def change(self, how: str) -> None:
        new = self._pattern(1)
        if how == "rewrite" and self.kind.endswith("numpy"):
            self.buffer[...] = new
        elif how == "data":
            self.mask.data.copy_(torch.from_numpy(new))
        else:
            self.mask.copy_(torch.from_numpy(new))

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k = F.layer_norm(q, (d,)), F.layer_norm(k, (d,))  # QK-norm: the logits stay within a few units
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=0.25)
        return self.proj(o.transpose(1, 2).reshape(b, t, c))


class EditLogits(_Block):
    """``("edit_logits",)``: part of the classes barred in place under no_grad (a vocabulary mask after an
    LM's head), which plain autograd allows when the op before did not save its output."""

    def forward(self, x):
        with torch.no_grad():
            x[..., : self.c // 4] = -30.0
        return x


class Residual(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, self.how, inner = spec
        self.inner = nn.Sequential(*[make_block(s, c, h, w) for s in inner])

    def forward(self, x):
        if self.how == "add":
            return x + self.inner(x)
        if self.how == "add_":
            return self.inner(x).add_(x)
        return x.add_(self.inner(x))  # "iadd": refused by plain autograd when inner saved x


class InPlace(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, self.op, self.target = spec
        if self.op in ("mul_param", "add_param"):
            self.param = nn.Parameter(1 + 0.1 * torch.randn(c))

    def forward(self, x):
        if self.target == "whole":
            view = x
        elif self.target == "slice":
            view = x[..., : self.c // 2]
        elif self.target == "transpose":
            view = x.transpose(1, 2)[:, : self.c // 2]
        else:  # "strided"
            view = x[..., ::2]
        if self.op == "add":
            view.add_(0.5)
        elif self.op == "mul":
            view.mul_(1.5)
        elif self.op == "relu_":
            view.relu_()
        elif self.op == "sigmoid_":
            view.sigmoid_()
        elif self.op == "tanh_":
            view.tanh_()
        else:
            p = self.param
            if self.target in ("slice", "strided"):
                p = p[: view.shape[-1]]
            elif self.target == "transpose":
                p = p[: view.shape[1], None]
            view.mul_(p) if self.op == "mul_param" else view.add_(p)
        return x


class View(_Block):
    def forward(self, x):
        _, kind, act = self.spec
        b, t, c = x.shape
        if kind == "heads":
            heads = 2
            y = activation(act, x.view(b, t, heads, c // heads).permute(0, 2, 1, 3))
            return y.permute(0, 2, 1, 3).reshape(b, t, c)
        if kind == "transpose":
            return activation(act, x.transpose(1, 2)).transpose(1, 2)  # left non-contiguous
        if kind == "slice":
            k = c // 2
            return torch.cat([activation(act, x[..., :k]), x[..., k:]], dim=-1)
        # "strided": every other channel through the activation, the others kept
        even = activation(act, x[..., 0::2])
        return torch.stack([even, x[..., 1::2]], dim=-1).reshape(b, t, c)


class Dropout(_Block):
    def __init__(self, spec, c, h, w):
        super().__init__(spec, c, h, w)
        _, self.p, self.mode = spec
        self.drop = nn.Dropout(self.p)
        if self.mode == "module_eval":
            self.drop.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.mode == "module_eval":
            self.drop.eval()
        return self

    def forward(self, x):
        if self.mode in ("module", "module_eval"):
            return self.drop(x)
        return F.dropout(x, self.p, training=True, inplace=self.mode == "inplace")


class Square(_Block):
    def forward(self, x):
        # Divided by its (detached) largest value: squares of squares would otherwise leave the normal range.
        y = x * x
        return y / y.detach().amax().clamp_min(1.0)


class Gate(_Block):
    def forward(self, x):
        return x * torch.sigmoid(x)


class Pool(_Block):
    def forward(self, x):
        return F.max_pool1d(x.transpose(1, 2), 3, stride=1, padding=1).transpose(1, 2)


_BLOCKS = {"linear": Linear, "mlp": MLP, "act": Act, "norm": Norm, "conv1d": Conv1d, "conv2d": Conv2d,
           "attention": Attention, "residual": Residual, "inplace": InPlace, "view": View, "dropout": Dropout,
           "square": Square, "gate": Gate, "pool": Pool, "masked_attention": MaskedAttention,
           "edit_logits": EditLogits}


def make_block(spec: tuple, c: int, h: int, w: int) -> nn.Module:
    return _BLOCKS[spec[0]](spec, c, h, w)


class Net(nn.Module):
    """The blocks of a ``ModelSpec`` in sequence, after ``x * input_scale`` (so that the first block
    sees a tensor with autograd history, not the leaf input)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(make_block(s, spec.channels, spec.height, spec.width) for s in spec.blocks)
        self.taps: list[torch.Tensor] = []  # the tensor ``mutate`` changes, when the spec asks for one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.spec.input_scale
        target = self.spec.mutate[0] if self.spec.mutate is not None else None  # "mask": see mutate
        for i, block in enumerate(self.blocks):
            h = block(h)
            if target == i:
                self.tap(h)
        return h

    def tap(self, h: torch.Tensor) -> None:
        how = self.spec.mutate[1]
        # Keep only what the mutation goes through: h itself, or an alias that shares its version counter.
        self.taps = [h if how in ("whole", "dropped") else h.view(-1) if how == "view" else h.detach()]

    def mutate(self, x: torch.Tensor) -> None:
        """The change made after forward and before backward, as an optimizer step or a careless
        user would make it (no_grad, in place). The tensor changed stays referenced until the next
        forward, except under "dropped", where nothing references it after the change."""
        if self.spec.mutate is None:
            return
        if self.spec.mutate[0] == "mask":  # every held mask, rewritten for the next batch
            for block in self.modules():
                if isinstance(block, MaskedAttention):
                    block.change(self.spec.mutate[1])
            return
        with torch.no_grad():
            if self.spec.mutate[0] == "input":
                x.add_(1.0)
            elif self.spec.mutate[1] == "dropped":
                self.taps.pop().add_(1.0)
            else:
                self.taps[-1].add_(1.0)


def build(spec: ModelSpec) -> Net:
    """The model of ``spec`` with weights from ``torch.manual_seed(spec.seed)``, in ``spec.dtype``."""
    torch.manual_seed(spec.seed)
    model = Net(spec)
    model.to(spec.torch_dtype)
    for module in model.modules():
        if isinstance(module, Conv2d) and module.channels_last:
            module.conv.to(memory_format=torch.channels_last)
    return model.train()
