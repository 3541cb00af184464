"""Rule ``norm_block``: a CNN block's output, ``act(norm(x) [+ shortcut])``, remade from the records it is a
function of, storing nothing.

A ResNet block stores its data up to three times: the batch norm's input (the conv's output) as codes,
ReLU's 1-bit mask, and the next conv's input ``relu(bn(x))`` (or ``relu(bn(x) + shortcut)``) as codes
again. The third holds nothing the first does not, given the norm's saved batch statistics and its
affine parameters and the shortcut: this rule walks the autograd graph back from the saved tensor
through ReLU/SiLU/GELU, additions and batch or group norms (in training: batch statistics) to records of
this forward (stored codes, or a save remade itself, such as the previous block's output), and remakes
the tensor in backward as the same expression of the decoded records. Any op saving such a tensor is
served: a conv, a max pool, a concatenation's reader.

The error is the records' through the expression: the norm input's code error times |weight| * rstd,
plus the shortcut's. What it reads in backward is checked: the records check their own tensors' versions;
the norm's weight, bias and saved statistics are held with their versions at pack time, and a change in
place (an optimizer step before backward) raises naming the site, never returns other values. The norm's
weight and bias come from the tracked ``F.batch_norm``/``F.group_norm`` call (``NormCalls``): autograd
does not save the bias, and a frozen one has no edge to find it by.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from daf.runtime.derived import DerivedActivation
from daf.runtime.held import SPLIT_READERS
from daf.runtime.records import Kept
from daf.runtime.remakes.records import Records
from daf.runtime.route import Remake
from daf.tracing import OpCall

__all__ = ["NormBlockRule", "NormCalls"]

_MOST_NODES = 8  # relu(bn2(x) + bn_shortcut(y)) is 4; a longer walk finds nothing more in a CNN block
_MOST_LEAVES = 3


class NormCalls:
    """Batch and group norm calls of one forward: their output's node -> (node, weight, bias)."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[Any, torch.Tensor | None, torch.Tensor | None]] = {}

    def note(self, call: OpCall) -> None:
        if call.func is F.batch_norm:
            weight, bias = _argument(call, "weight", 3), _argument(call, "bias", 4)
        elif call.func is F.group_norm:
            weight, bias = _argument(call, "weight", 2), _argument(call, "bias", 3)
        else:
            return
        output = call.output
        if isinstance(output, torch.Tensor) and output.grad_fn is not None and output.output_nr == 0:
            self._calls[id(output.grad_fn)] = (output.grad_fn, weight, bias)

    def get(self, node: Any) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        entry = self._calls.get(id(node))
        return entry[1:] if entry is not None and entry[0] is node else None

    def clear(self) -> None:
        self._calls.clear()


def _argument(call: OpCall, name: str, position: int) -> torch.Tensor | None:
    value = call.kwargs.get(name, call.args[position] if len(call.args) > position else None)
    return value if isinstance(value, torch.Tensor) else None


# -- the expression ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Leaf:
    index: int


@dataclass(frozen=True)
class _Activation:
    child: Any
    function: Callable[[torch.Tensor], torch.Tensor]
    name: str


@dataclass(frozen=True)
class _Masked:
    """``relu(child) * mask`` with ReLU's own exact mask: zero exactly where forward's output was, so that
    a code error never turns a zero into a value or a kept value into a zero."""

    child: Any
    mask: int


@dataclass(frozen=True)
class _Add:
    left: Any
    right: Any
    alpha: float


@dataclass(frozen=True)
class _Norm:
    """``(x - mean) * rstd * weight + bias`` per channel (batch norm) or per sample and group (group norm);
    ``held``: the tensors read in backward with their versions at pack time."""

    child: Any
    groups: int  # 0: batch norm
    mean: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    held: tuple[tuple[str, torch.Tensor, int], ...]


_ACTIVATIONS = {"ReluBackward0": ("relu", lambda node: torch.relu),
                "SiluBackward0": ("silu", lambda node: F.silu),
                "GeluBackward0": ("gelu", lambda node: functools.partial(F.gelu, approximate=node._saved_approximate))}


class NormBlockRule:
    """``lost_bits``: what a remake through an activation is worth less than its records' width. ReLU (SiLU,
    GELU) keeps about half of the norm's output range, which codes of the output itself cover with the same
    levels: a remake from 2-bit codes of the norm's input has about twice their step on the kept elements
    (measured on a ResNet-style net at random init, one gradient: relative error 0.64 remade from 2-bit
    records against 0.41 with 2-bit codes of its own; 0.15 remade from 4-bit records;
    ``benchmarks/block_remakes.py``). So routing remakes it only where the policy gives the save no more
    than the records' width less one bit (``daf.runtime.route.derives``), and keeps codes elsewhere."""

    name = "norm_block"

    def __init__(self, lost_bits: int = 1) -> None:
        if not isinstance(lost_bits, int) or lost_bits < 0:
            raise ValueError(f"NormBlockRule.lost_bits is an int >= 0, got {lost_bits!r}")
        self.lost_bits = lost_bits

    def find(self, tensor: torch.Tensor, op: OpCall | None, records: Records) -> Remake | None:
        node = tensor.grad_fn
        if node is None or type(node).__name__ not in _TOP or tensor.output_nr != 0:
            return None
        mask = records.relu_mask(tensor) if type(node).__name__ == "ReluBackward0" else None
        walk = _Walk(records, mask)
        expression = walk.expression(node, 0, top=True)
        if mask is not None and expression is not None:
            index = walk.leaf(mask)
            expression = None if index is None else _Masked(expression.child, index.index)
        if expression is None or isinstance(expression, _Leaf):
            return None
        leaves = tuple(walk.leaves)
        if any(_split(leaf) and not (isinstance(expression, _Masked) and leaf.mask is mask) for leaf in leaves):
            return None  # a split record's masked-out elements are group means: only its own mask may read them
        bits = min(_bits(leaf) for leaf in leaves)  # an exact mask: 32
        if _activated(expression) and any(_loses_levels(leaf) for leaf in leaves):
            bits -= self.lost_bits
        function = functools.partial(_remade, expression=expression, shape=tuple(tensor.shape))
        sites = ", ".join(getattr(leaf, "site", "?") for leaf in leaves)
        why = f"{self.name}: remade as {_describe(expression)} from {sites}"
        return Remake(leaves, function, bits, rule=self.name, why=why)


_TOP = frozenset({*_ACTIVATIONS, "AddBackward0", "NativeBatchNormBackward0", "NativeGroupNormBackward0"})


class _Walk:
    """One walk back from a saved tensor's node: the expression and its leaves (records). A record found
    ends the walk there, a remade one too (SiLU's input, remade from the norm's, is the leaf of SiLU's output)."""

    def __init__(self, records: Records, mask: Any = None) -> None:
        self.records, self.leaves, self.nodes, self.mask = records, [], 0, mask

    def expression(self, node: Any, output_nr: int, top: bool = False, reader: str | None = None) -> Any:
        if node is None:
            return None
        if not top:
            leaf = (self.records.remade_output(node, output_nr) or self.records.record_of(node, output_nr, reader)
                    or self._split_by_mask(node, output_nr))
            if leaf is not None:
                return self.leaf(leaf)
        self.nodes += 1
        if self.nodes > _MOST_NODES or output_nr != 0:
            return None
        name = type(node).__name__
        if name in _ACTIVATIONS:
            label, make = _ACTIVATIONS[name]
            child = self.expression(*node.next_functions[0])
            return None if child is None else _Activation(child, make(node), label)
        if name == "AddBackward0":
            return self._add(node)
        if name in ("NativeBatchNormBackward0", "NativeGroupNormBackward0"):
            return self._norm(node, groups=0 if name == "NativeBatchNormBackward0" else node._saved_group)
        return None

    def _split_by_mask(self, node: Any, output_nr: int) -> Any:
        """A norm input split by the ReLU mask this walk's expression is multiplied by (``relu(norm(x) + x)``:
        ``x`` is read outside the norm too, where the mask zeroes its group means)."""
        if self.mask is None:
            return None
        record = self.records.record_of(node, output_nr, "batch_norm") or self.records.record_of(node, output_nr, "group_norm")
        return record if record is not None and getattr(record, "mask", None) is self.mask else None

    def leaf(self, record: Any) -> _Leaf | None:
        for index, known in enumerate(self.leaves):
            if known is record:
                return _Leaf(index)
        if len(self.leaves) >= _MOST_LEAVES:
            return None
        self.leaves.append(record)
        return _Leaf(len(self.leaves) - 1)

    def _add(self, node: Any) -> _Add | None:
        (left, left_nr), (right, right_nr) = node.next_functions
        alpha = node._saved_alpha
        if not isinstance(alpha, (int, float)):
            return None
        a = self.expression(left, left_nr)
        b = self.expression(right, right_nr) if a is not None else None
        return None if b is None else _Add(a, b, float(alpha))

    def _norm(self, node: Any, groups: int) -> _Norm | None:
        records = self.records
        if not records.readable(node) or (groups == 0 and not node._saved_training):
            return None  # eval-mode batch norm reads running statistics a later forward may update
        affine = records.norms.get(node)
        if affine is None:
            return None
        statistics = [records.record_behind(node, name) for name in ("_saved_result1", "_saved_result2")]
        if not all(isinstance(s, Kept) for s in statistics):
            return None  # coded statistics: not exact
        mean, rstd = (s.tensor for s in statistics)
        weight, bias = affine
        # a norm's input split by the ReLU mask after it (daf.runtime.held) is read here, by the norm
        child = self.expression(*node.next_functions[0], reader="batch_norm" if groups == 0 else "group_norm")
        if child is None:
            return None
        held = tuple((label, t, t._version) for label, t in
                     (("mean", mean), ("rstd", rstd), ("weight", weight), ("bias", bias)) if t is not None)
        return _Norm(child, groups, mean, rstd, weight, bias, held)


def _bits(record: Any) -> int:
    bits = getattr(record, "bits", 0)
    return bits if bits and not getattr(record, "exact", False) else 32


def _split(record: Any) -> bool:
    return getattr(record, "readers", None) == SPLIT_READERS


def _loses_levels(record: Any) -> bool:
    """Whether ReLU keeps about half of ``record``'s levels: plain codes. Not a norm input split by the ReLU
    mask (``daf.runtime.held``: its codes span the kept elements alone), a ReLU output's nonzeros, a remade
    save (its bits count its own loss) or an exact record."""
    if isinstance(record, (DerivedActivation, Kept)):
        return False
    return getattr(record, "mask", None) is None and not getattr(record, "exact", False)


def _activated(expression: Any) -> bool:
    if isinstance(expression, (_Activation, _Masked)):
        return True
    if isinstance(expression, _Add):
        return _activated(expression.left) or _activated(expression.right)
    return isinstance(expression, _Norm) and _activated(expression.child)


def _describe(expression: Any) -> str:
    if isinstance(expression, _Leaf):
        return "x"
    if isinstance(expression, _Activation):
        return f"{expression.name}({_describe(expression.child)})"
    if isinstance(expression, _Masked):
        return f"relu({_describe(expression.child)}) * mask"
    if isinstance(expression, _Add):
        return f"{_describe(expression.left)} + {_describe(expression.right)}"
    kind = "batch_norm" if expression.groups == 0 else "group_norm"
    return f"{kind}({_describe(expression.child)})"


# -- backward ------------------------------------------------------------------------------------------
def _remade(*leaves: torch.Tensor, expression: Any, shape: tuple[int, ...]) -> torch.Tensor:
    return _evaluate(expression, leaves)[0].reshape(shape)


# In-place forms of the activations, for a tensor the remake made itself (GELU has none)
_IN_PLACE = {"relu": torch.relu_, "silu": functools.partial(F.silu, inplace=True)}


def _evaluate(expression: Any, leaves: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, bool]:
    """The expression's value, and whether the remake made it (so later steps may write into it). A leaf is a
    decoded record, which the session may hand to another reader (``daf.runtime.recent``): never written. Each
    step after the first writes into what the one before made, so a block's remake holds one full-size
    temporary beside its leaves, not one per operation (resnet18-fmnist's model, split norm inputs: the
    backward's tensor peak 269 -> 245 MiB with the split's own change: benchmarks/rss_by_step.py), with
    the same arithmetic in the same order."""
    if isinstance(expression, _Leaf):
        return leaves[expression.index], False
    if isinstance(expression, _Activation):
        child, owned = _evaluate(expression.child, leaves)
        in_place = _IN_PLACE.get(expression.name) if owned else None
        return (in_place(child) if in_place is not None else expression.function(child)), True
    if isinstance(expression, _Masked):
        child, owned = _evaluate(expression.child, leaves)
        return (torch.relu_(child) if owned else torch.relu(child)).mul_(leaves[expression.mask]), True
    if isinstance(expression, _Add):
        (left, left_owned), (right, _) = _evaluate(expression.left, leaves), _evaluate(expression.right, leaves)
        if left_owned and left.shape == torch.broadcast_shapes(left.shape, right.shape):
            return left.add_(right, alpha=expression.alpha), True
        return torch.add(left, right, alpha=expression.alpha), True
    return _normalize(expression, _evaluate(expression.child, leaves)[0]), True


def _normalize(norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    """The norm's output from its decoded input, in float32 as the CPU kernels compute it; a new tensor (``x`` is
    read, never written), which each step after the subtraction writes into."""
    for label, tensor, version in norm.held:
        if tensor._version != version:
            raise RuntimeError(
                f"DAF: the {'batch' if norm.groups == 0 else 'group'} norm's {label} [{tensor.type()} "
                f"{list(tensor.shape)}] changed in place since forward (version {tensor._version}, {version} then). "
                f"DAF remakes a block's output from it in backward (daf.runtime.remakes.blocks), which would now "
                f"give other values than forward's (plain PyTorch raises for the weight too). Change parameters "
                f"after backward (loss.backward() before optimizer.step()), or out of place.")
    dtype, x = x.dtype, x.float()
    channel = (1, -1) + (1,) * (x.dim() - 2)
    if norm.groups == 0:
        y = (x - norm.mean.float().view(channel)).mul_(norm.rstd.float().view(channel))
    else:
        statistic = (x.shape[0], norm.groups, 1)
        y = (x.reshape(x.shape[0], norm.groups, -1) - norm.mean.float().view(statistic))
        y = y.mul_(norm.rstd.float().view(statistic)).view(x.shape)
    if norm.weight is not None:
        y.mul_(norm.weight.detach().float().view(channel))
    if norm.bias is not None:
        y.add_(norm.bias.detach().float().view(channel))
    return y.to(dtype)
