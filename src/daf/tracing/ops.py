"""Which torch function is saving a tensor, and what it returned: a ``TorchFunctionMode``.

Saved-tensor hooks see the tensor but not the op that saves it. While a session's
hooks are active this mode records the top-level torch function being run, so that
the pack hook can tell (1) that the tensor is ReLU's own saved output, which backward
reads only as a mask, and (2) which op consumes the tensor, its arguments and its
output, whose gradient is the one that flows into that op during backward.

Inside a mode's handler the mode is off, so calls made by the function itself
(``F.relu`` calling ``torch.relu``) are not seen again: the function recorded is
the outermost one the model called. Cost: one Python call per torch function run
in forward while the mode is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import types
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OpCall", "OpTracker", "RELU_FUNCTIONS", "ATTENTION_FUNCTIONS", "WEIGHT_FUNCTIONS", "CONTAINER_FUNCTIONS"]


def _relu_functions() -> frozenset:
    import torch.nn.functional as F
    return frozenset({torch.relu, torch.relu_, F.relu, F.relu_, torch.Tensor.relu, torch.Tensor.relu_})


RELU_FUNCTIONS = _relu_functions()

# q, k, v of fused attention, by keyword and position (``fused_attention_role``).
_ATTENTION_INPUTS = (("query", 0), ("key", 1), ("value", 2))


def _attention_functions() -> frozenset:
    import torch.nn.functional as F
    return frozenset({F.scaled_dot_product_attention})


ATTENTION_FUNCTIONS = _attention_functions()


def _weight_functions() -> frozenset:
    """The functions autocast runs in low precision that take a weight: their saves can be its cast; and
    attention, whose saves without history made inside it (the math path's reshaped key of a frozen
    projection) backward only multiplies by, like a matmul's (under the exponent guard's 8 bits)."""
    import torch.nn.functional as F
    return frozenset({F.scaled_dot_product_attention, F.linear, F.bilinear, torch.matmul, torch.mm, torch.addmm, torch.bmm, torch.baddbmm,
                      torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm,
                      F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d})


WEIGHT_FUNCTIONS = _weight_functions()


def _container_functions() -> frozenset:
    """Python functions that are a sequence of torch calls rather than one op, traced call by call:
    ``nn.MultiheadAttention``'s forward runs its projections and fused attention inside one, and behind
    it the exponent guard never saw q and k (4-bit codes; ``nn.TransformerEncoder`` with large channels:
    gradient cosine 0.01)."""
    import torch.nn.functional as F
    return frozenset({F.multi_head_attention_forward})


CONTAINER_FUNCTIONS = _container_functions()


def body_of(func: Callable) -> Callable:
    """A copy of the Python function ``func`` whose own check for torch-function handlers
    (``has_torch_function``, its first statement) answers no, so that called under a mode it runs its body
    instead of handing itself to the mode again; the calls in the body still reach the mode. ``func`` itself
    where it has no such check by that name (it is then traced as one op)."""
    if "has_torch_function" not in func.__code__.co_names:  # another torch's check: traced whole, as before
        return func
    namespace = dict(func.__globals__)
    namespace["has_torch_function"] = lambda *args: False
    body = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


def tensors_in(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among ``values`` and among the lists and tuples in them (one level: ``torch.cat``'s)."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(t for t in value if isinstance(t, torch.Tensor))
    return found


@dataclass
class OpCall:
    """One top-level torch function call that saved tensors for backward.

    ``saves`` holds ``(site, tensor)`` for each tensor it saved that DAF stores
    (``site`` is the site of the record, which for a shared tensor is where it was
    first stored); ``output`` is what the function returned.
    """

    func: Callable
    args: tuple
    kwargs: dict
    saves: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    output: Any = None

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", type(self.func).__name__)

    @property
    def is_relu(self) -> bool:
        return self.func in RELU_FUNCTIONS

    @cached_property
    def weight_arguments(self) -> list[torch.Tensor]:
        """The tensors given to a linear, matmul or convolution (``WEIGHT_FUNCTIONS``); empty for other calls.
        Made once per call: routing and the session ask it for each save of the call without history."""
        if self.func not in WEIGHT_FUNCTIONS:
            return []
        return [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, torch.Tensor)]

    @cached_property
    def tensor_arguments(self) -> list[torch.Tensor]:
        """Every tensor the call was given (``tensors_in``); made once per call."""
        return tensors_in((*self.args, *self.kwargs.values()))

    @cached_property
    def argument_nodes(self) -> set[int]:
        """The ids of the autograd nodes that made the call's tensor arguments: where the nodes it made end."""
        return {id(t.grad_fn) for t in self.tensor_arguments if t.grad_fn is not None}

    def fused_attention_role(self, tensor: torch.Tensor) -> str | None:
        """What ``tensor`` is to a fused-attention kernel's backward: "logits" for q and k (and copies made
        inside the call, the fused kernels' or the math path's, not told apart), which it exponentiates
        against the saved logsumexp; "values" for v and the kernel's output; None for other saves."""
        if self.func not in ATTENTION_FUNCTIONS:
            return None
        if tensor.grad_fn is None:
            return "logits"
        if "Attention" in type(tensor.grad_fn).__name__:
            return "values"  # the kernel's own output
        for name, position in _ATTENTION_INPUTS:
            given = self.kwargs.get(name, self.args[position] if len(self.args) > position else None)
            if given is tensor:
                return "values" if name == "value" else "logits"
        return None

    @property
    def attention_value(self) -> torch.Tensor | None:
        """The ``value`` an attention call was given; None for other calls."""
        if self.func not in ATTENTION_FUNCTIONS:
            return None
        value = self.kwargs.get("value", self.args[2] if len(self.args) > 2 else None)
        return value if isinstance(value, torch.Tensor) else None

    def is_attention_statistic(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``, saved by this fused-attention call without history, has the shape of its
        logsumexp (the query's without its last dimension), in float32."""
        if self.func not in ATTENTION_FUNCTIONS or tensor.grad_fn is not None or tensor.dtype != torch.float32:
            return False
        query = self.kwargs.get("query", self.args[0] if self.args else None)
        return isinstance(query, torch.Tensor) and tuple(tensor.shape) == tuple(query.shape[:-1])

    @property
    def attention_logits(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``(query, key, scale)`` of an attention call: the operands of its logits and what their product
        is multiplied by (the call's ``scale``, else 1 / sqrt(head size)); None for other calls."""
        if self.func not in ATTENTION_FUNCTIONS:
            return None
        query = self.kwargs.get("query", self.args[0] if self.args else None)
        key = self.kwargs.get("key", self.args[1] if len(self.args) > 1 else None)
        if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)) or query.dim() == 0:
            return None
        scale = self.kwargs.get("scale", self.args[7] if len(self.args) > 7 else None)
        return query, key, float(scale) if scale is not None else query.shape[-1] ** -0.5

    @property
    def attention_arguments(self) -> tuple[torch.Tensor | None, bool] | None:
        """``(attn_mask, is_causal)`` of an attention call (what its math path adds to the scores); None
        for other calls."""
        if self.func not in ATTENTION_FUNCTIONS:
            return None
        mask = self.kwargs.get("attn_mask", self.args[3] if len(self.args) > 3 else None)
        causal = self.kwargs.get("is_causal", self.args[5] if len(self.args) > 5 else False)
        return mask, bool(causal)

    @property
    def remakes_attention_output(self) -> bool:
        """Whether DAF remakes this attention call's output from its q, k and v in backward
        (``daf.tracing.products.attention_output_of``): the CPU kernel without dropout."""
        query = self.kwargs.get("query", self.args[0] if self.args else None)
        dropout = self.kwargs.get("dropout_p", self.args[4] if len(self.args) > 4 else 0.0)
        return isinstance(query, torch.Tensor) and query.device.type == "cpu" and not dropout


class OpTracker(TorchFunctionMode):
    """Keeps the current top-level call; ``on_done(call)`` runs after each call whose saves went through
    the pack hook (the hook asked for ``current``; saves under another hook, checkpointing's, do not).

    The ``OpCall`` is made only when the pack hook asks for it (``current``), so calls that save
    nothing (views, shape queries) cost a few attribute stores.
    """

    def __init__(self, on_done: Callable[[OpCall], None]) -> None:
        super().__init__()
        self._frame: tuple | None = None
        self._call: OpCall | None = None
        self._on_done = on_done
        self._bodies: dict[Callable, Callable] = {}  # CONTAINER_FUNCTIONS' bodies, made on first call

    @property
    def current(self) -> OpCall | None:
        """The call running now (made on first use), or None outside any call."""
        if self._call is None and self._frame is not None:
            self._call = OpCall(*self._frame)
        return self._call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CONTAINER_FUNCTIONS and self._frame is None:
            if func not in self._bodies:
                self._bodies[func] = body_of(func)
            if self._bodies[func] is not func:
                with self:  # a mode is off inside its own handler: on again for the body's calls
                    return self._bodies[func](*args, **kwargs)
        outer = (self._frame, self._call)
        self._frame, self._call = (func, args, kwargs), None
        try:
            output = func(*args, **kwargs)
            call = self._call
        finally:
            self._frame, self._call = outer
        if call is not None:
            call.output = output
            self._on_done(call)
        return output
