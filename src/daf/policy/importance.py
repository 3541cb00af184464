"""How much gradient variance each saved-activation site adds at each bit width, from the normal backward.

Stochastic rounding leaves the saved tensor unbiased with an error ``e`` of known
variance: an element at fraction ``p`` of its quantization step ``D`` gets
``Var(e) = D**2 * p * (1 - p)``. ``rounding_variance`` evaluates that on a sample
of groups for every bit width (``V(b)``, mean per element): it is exact for the
data at hand, so sparse tensors (softmax probabilities), whose error shrinks
like ``1/(2**b - 1)`` rather than ``1/(2**b - 1)**2``, are costed right.

What that error does to the parameter gradients depends on the op that reads the
tensor in backward (its *consumer*, seen through ``daf.tracing``):

* **matmul-like** (linear, conv, matmul, bmm): ``y = x W`` gives ``grad_W = dy^T x``,
  so an error in ``x`` adds ``sum_j Var(e_j) * ||dy_row(j)||**2``, about
  ``V(b) * fan_in * ||dy||**2`` where ``fan_in`` is the contraction length
  (``C_in * k * k`` for a convolution). ``dy`` is the gradient that flows into the
  op: a hook on the op's output reads it during the normal backward. When the
  other operand is a parameter that error is in a parameter gradient; when it is
  an activation (attention's ``q @ k^T``) it is an error in that activation's
  gradient and is carried back to the parameters upstream (below).
* **everything else** (BatchNorm, LayerNorm, GELU, softmax, tanh): the error
  changes the gradient the op passes back to its input by about the relative error
  of ``x``, ``V(b) / Var(x)``, times that gradient. An error ``d`` injected into an
  activation's gradient reaches the parameters upstream (those the forward used
  before the op) scaled like the true gradient there: by
  ``P_up / ||grad||**2``, with ``P_up`` the squared norm of those parameters'
  gradients (hooks on the parameters). So the cost is ``V(b) / Var(x) * P_up``;
  a trainable affine weight of the op adds ``V(b) / Var(x) * ||dy||**2``.

That generic model is not checked: on random-init transformers leave-one-in puts it 50-100x too high
at the median (``SiteStats.generic`` marks the sites it costs; the adaptive policy does not trade them).

Summed over the consumers of a tensor this gives ``cost(b) = W * V(b)`` per site:
the sum over sites is the estimated squared error of the whole parameter gradient.
Each quantity is smoothed over the steps it was measured in (exponential average).
No extra forward or backward: only hooks on tensors the backward computes anyway,
and a sample of at most ``max_groups`` groups per tensor.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import torch

from daf.policy.sampling import batched_rounding_variance, group_sample, rounding_variance, strided_sample
from daf.tracing import OpCall, is_parameter, shares_storage

__all__ = ["rounding_variance", "ImportanceEstimator", "SiteStats", "MATMUL_FUNCTIONS", "COMPOUNDING"]

COMPOUNDING = 100.0
_SMALL_PARAM = 1 << 16  # parameters up to this many elements keep their last gradient (BatchNorm's gamma)
MATMUL_FUNCTIONS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul", "__matmul__", "__rmatmul__",
                              "bmm", "mm", "addmm", "baddbmm"})


@dataclass
class SiteStats:
    """What is known about one site; ``weight * variance[b]`` is its estimated cost at ``b`` bits."""

    numel: int = 0  # elements stored
    elements: int = 0  # elements of the activation (more than numel when the zeros need no codes)
    dtype_bits: int = 32
    variance: torch.Tensor | None = None  # V(b) per choice, smoothed
    data_var: float = 0.0
    weight: float | None = None  # smoothed
    steps: int = 0  # steps whose weight was measured
    # some consumer turns the error into an error of an activation gradient, which backward carries on
    # through every layer below: at 1 bit that noise is as large as the signal and compounds
    propagates: bool = False
    # some consumer is costed by the generic model (a non-parameter consumer: LayerNorm/RMSNorm, GELU,
    # softmax, attention's q @ k^T, an elementwise product), which assumes the injected error keeps its
    # relative size in every gradient upstream. Leave-one-in on random-init transformers puts it 50-100x
    # too high at the median (a residual branch's error is small next to the stream's gradient, it seems),
    # so the policy does not trade such a site's bits (docs/policy.md section 1, "Where the model is unsure")
    generic: bool = False


class ImportanceEstimator:
    """Per-site smoothed estimates of the gradient variance added at each bit width.

    Owned by one policy (one session); no state outside it. ``observe_tensor`` and
    ``observe_call`` run in forward, hooks fill in during backward, and ``fold``
    (at the next forward) turns the step's measurements into the smoothed estimates.
    """

    def __init__(self, group_size: int, choices: tuple[int, ...], smoothing: float = 0.7,
                 max_groups: int = 64) -> None:
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.group_size = group_size
        self.choices = tuple(choices)
        self.smoothing = smoothing
        self.max_groups = max_groups
        self.sites: dict[str, SiteStats] = {}
        self._calls = 0  # op calls observed in this forward
        self._input_var: dict[int, float] = {}  # output data_ptr -> Var(input) of a product with a parameter
        self._param_norm: dict[int, float] = {}  # id(param) -> ||grad||^2 of its last backward
        self._param_grad: dict[int, torch.Tensor] = {}  # id(param) -> its last gradient, for small ones
        self._param_handles: dict[int, Any] = {}
        self._uses: list[tuple[str, str, dict[str, Any]]] = []  # (site, kind, measured figures) this step
        self._visited: set[Any] = set()  # autograd nodes walked this step looking for input leaves
        # (site, sample of groups, density of the nonzeros or None, their Var or None) this step
        self._samples: list[tuple[str, torch.Tensor, float | None, float | None]] = []

    # -- forward -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Fold the last step's measurements (its backward has run) and start a new step."""
        self.fold()
        self._calls = 0
        self._input_var.clear()
        self._visited.clear()

    def observe_tensor(self, site: str, x: torch.Tensor, elements: int | None = None) -> None:
        """Take the sample of ``x`` stored at ``site`` whose ``V(b)`` and ``Var(x)`` ``fold`` measures. O(sample).

        ``elements``: when ``x`` holds only part of the activation (the nonzeros of a ReLU
        output, its zeros given exactly by the mask), the activation's element count. The
        others carry no error, so ``V(b)``, a mean over the activation, is scaled by
        ``x.numel() / elements``.

        The sample (at most ``max_groups`` groups, a copy) waits for ``fold``, which measures every
        site's in one batch: a few tensor ops per step instead of some forty per site.
        """
        stats = self.sites.setdefault(site, SiteStats())
        stats.numel = x.numel()
        stats.elements = elements or x.numel()
        stats.dtype_bits = x.element_size() * 8
        density = data_var = None
        if elements:
            density = x.numel() / elements
            sample = strided_sample(x)
            data_var = density * float(sample.square().mean()) - (density * float(sample.mean())) ** 2
        self._samples.append((site, group_sample(x, self.group_size, self.max_groups), density, data_var))

    def observe_call(self, call: OpCall) -> None:
        """Register the hooks that measure, in backward, how the op's use of its saved tensors matters."""
        order, self._calls = self._calls, self._calls + 1
        output = _first_tensor(call.output)
        self._hook_input_leaves(call, order)
        for site, x in call.saves:
            use: dict[str, Any] = {"order": order}
            matmul = _matmul_role(call, x)
            if matmul is not None:
                fan, other = matmul
                if other is None or not other.requires_grad or output is None or not output.requires_grad:
                    continue  # nothing downstream of this use depends on x
                use.update(fan=fan, direct=is_parameter(other), mean_square=_mean_square(x))
                if use["direct"]:
                    self._input_var[output.data_ptr()] = _variance(x)
                if site not in self.sites:  # kept raw (the input batch): only its noise power counts
                    if use["direct"]:
                        _hook_norm(output, use, "dy")
                        self._uses.append((site, "power", use))
                    continue
                if not use["direct"]:
                    _hook_norm(other, use, "other")
                _hook_norm(output, use, "dy")
                self._uses.append((site, "matmul", use))
            elif site not in self.sites:
                continue
            elif call.name == "batch_norm" and _bn_weight(call) is not None and x.dim() >= 2 \
                    and output is not None and output.requires_grad and x.requires_grad:
                weight = _bn_weight(call)
                self._hook_param(weight)
                # per-channel reductions in place: a transposed copy of the input cost as much again
                variance = x.detach().float().var(dim=_non_channel_dims(x), unbiased=False)
                use.update(gamma=weight.detach().float().reshape(-1).clone(), weight_id=id(weight),
                           count=x.numel() // x.shape[1], invstd=(variance + 1e-5).rsqrt(),
                           input_var=self._input_var.get(x.data_ptr()))
                _hook_channel_norms(output, use, "dy_channel")
                _hook_norm(x, use, "gx")
                self._uses.append((site, "batch_norm", use))
            else:
                use["affine"] = any(is_parameter(a) for a in call.tensor_arguments)
                if use["affine"] and output is not None and output.requires_grad:
                    _hook_norm(output, use, "dy")
                self._uses.append((site, "other", use))

    # -- after backward ----------------------------------------------------------------------
    def fold(self) -> None:
        """Turn the measurements of the last step into each site's smoothed ``V(b)``, ``Var(x)`` and
        ``weight``. O(samples + uses * params)."""
        self._fold_samples()
        # Noise power an error injected into an activation gradient picks up on its way back: each
        # upstream product with a parameter turns an error d in its output gradient into
        # ||d||**2 * fan * E[input**2] of weight-gradient error; in units of the gradient there.
        powers = sorted((use["order"], use["dy"] * use["fan"] * use["mean_square"])
                        for _, kind, use in self._uses if kind in ("matmul", "power") and use["direct"] and "dy" in use)
        # an input that requires grad (not a parameter) is a gradient the caller wants: its own norm
        powers = sorted(powers + [(use["order"], use["leaf"]) for _, kind, use in self._uses
                                  if kind == "leaf" and "leaf" in use])
        orders = [o for o, _ in powers]
        prefix = [0.0]
        for _, power in powers:
            prefix.append(prefix[-1] + power)
        step: dict[str, float] = {}
        for site, kind, use in self._uses:
            up = prefix[bisect.bisect_left(orders, use["order"])]
            if kind in ("power", "leaf"):
                continue
            if kind == "matmul":
                if "dy" not in use:
                    continue  # backward did not reach this op
                w = use["dy"] * use["fan"]
                if not use["direct"]:
                    other = use.get("other", 0.0)
                    w = w * up / other if other > 0 else 0.0
            elif kind == "batch_norm":
                w = _batch_norm_weight(use, up, self._param_grad.get(use["weight_id"]))
                if w is None:
                    continue
            else:
                stats = self.sites[site]
                if stats.data_var <= 0:
                    continue
                w = up / stats.data_var
                if use["affine"]:
                    w += use.get("dy", 0.0) / stats.data_var
            step[site] = step.get(site, 0.0) + w
            if kind != "matmul" or not use["direct"]:
                self.sites[site].propagates = True
            if kind == "other" or (kind == "matmul" and not use["direct"]):
                self.sites[site].generic = True
        self._uses = []
        for site, w in step.items():
            stats = self.sites[site]
            a = self.smoothing if stats.weight is not None else 0.0
            stats.weight = w if stats.weight is None else a * stats.weight + (1 - a) * w
            stats.steps += 1

    def _fold_samples(self) -> None:
        """Smooth in ``V(b)`` and ``Var(x)`` of this step's samples: all whole-group samples in one batch."""
        samples, self._samples = self._samples, []
        whole = [item for item in samples if item[1].shape[1] == self.group_size]
        measured = dict(zip([item[0] for item in whole],
                            batched_rounding_variance([item[1] for item in whole], self.choices)))
        for site, sample, density, nonzeros_var in samples:
            if site in measured:
                variance, data_var = measured[site]
            else:  # fewer elements than a group
                variance, data_var = rounding_variance(sample, sample.shape[1], self.choices)
            if density is not None:
                variance, data_var = variance * density, nonzeros_var
            stats = self.sites[site]
            a = self.smoothing if stats.variance is not None else 0.0
            stats.variance = variance if stats.variance is None else a * stats.variance + (1 - a) * variance
            stats.data_var = a * stats.data_var + (1 - a) * data_var

    def costs(self, site: str) -> dict[int, float] | None:
        """{bits: estimated added gradient variance} for a site with a measured weight, else None.

        For a site whose error propagates through backward (``SiteStats.propagates``) the
        1-bit cost is multiplied by ``COMPOUNDING``: the additive model holds only while each
        site's relative error is small, and 1-bit errors in activation gradients multiply
        layer after layer (MiniLM at 1 bit everywhere: relative gradient error ~1e8).
        """
        stats = self.sites.get(site)
        if stats is None or stats.weight is None or stats.variance is None:
            return None
        costs = {b: float(stats.weight * v) for b, v in zip(self.choices, stats.variance)}
        if stats.propagates and 1 in costs:
            costs[1] *= COMPOUNDING
        return costs

    def close(self) -> None:
        """Remove the parameter hooks."""
        for handle in self._param_handles.values():
            handle.remove()
        self._param_handles.clear()

    # -- helpers -----------------------------------------------------------------------------
    def _hook_input_leaves(self, call: OpCall, order: int) -> None:
        """Hook the gradient norm of every leaf that requires grad and is no parameter (an input the
        caller differentiates) upstream of the call's arguments, the first time this step a walk meets
        it. Without it a site whose error reaches only such an input was costed 0 at every width, and
        the plan dropped it to 1 bit for free (issue 13). O(new autograd nodes): each node once a step."""
        stack = [t.grad_fn for t in call.tensor_arguments if t.grad_fn is not None]
        for t in call.tensor_arguments:
            if t.grad_fn is None and t.requires_grad and not isinstance(t, torch.nn.Parameter) \
                    and id(t) not in self._visited:
                self._visited.add(id(t))
                self._hook_leaf(t, order)
        while stack:
            node = stack.pop()
            if node in self._visited:
                continue
            self._visited.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                if not isinstance(variable, torch.nn.Parameter) and id(variable) not in self._visited:
                    self._visited.add(id(variable))
                    self._hook_leaf(variable, order)
                continue
            stack.extend(n for n, _ in node.next_functions if n is not None)

    def _hook_leaf(self, leaf: torch.Tensor, order: int) -> None:
        # it is upstream of this call: counted for the errors injected here and after (order - 0.5)
        use: dict[str, Any] = {"order": order - 0.5}
        _hook_norm(leaf, use, "leaf")
        self._uses.append(("", "leaf", use))

    def _hook_param(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._param_handles:
            return
        norms, grads = self._param_norm, self._param_grad
        small = p.numel() <= _SMALL_PARAM

        def hook(grad: torch.Tensor) -> None:
            norms[key] = _squared_norm(grad)
            if small:
                grads[key] = grad.detach().float().reshape(-1).clone()

        self._param_handles[key] = p.register_hook(hook)


def _variance(x: torch.Tensor) -> float:
    """Variance of ``x`` over a strided sample. O(sample)."""
    return float(strided_sample(x).var()) if x.numel() > 1 else 0.0


def _mean_square(x: torch.Tensor) -> float:
    """Mean of ``x**2`` over a strided sample. O(sample)."""
    return float(strided_sample(x).square().mean()) if x.numel() else 0.0


def _bn_weight(call: OpCall) -> torch.Tensor | None:
    weight = call.kwargs.get("weight", call.args[3] if len(call.args) > 3 else None)
    return weight if isinstance(weight, torch.Tensor) and is_parameter(weight) else None


def _batch_norm_weight(use: dict[str, Any], upstream: float, grad_gamma: torch.Tensor | None) -> float | None:
    """Gradient variance per unit of input rounding variance for BatchNorm's saved input.

    BatchNorm's backward is ``dx = g * s * (dy - mean(dy) - xh * m)`` per channel, with
    ``s = 1/std``, ``xh`` the normalized input and ``m = mean(dy * xh) = grad_gamma / M``.
    An error ``e`` in ``x`` moves ``xh`` by ``e * s``, so ``dx`` by about
    ``-g * s**2 * (e * m + xh * mean(dy * e))``: per channel a variance of
    ``V * g**2 * s**4 * (M * m**2 + ||dy_c||**2 / M)`` summed over the ``M`` elements. That
    error reaches the parameters upstream like ``dx`` does (``upstream / ||dx||**2``);
    ``grad_gamma`` itself moves by ``V * s**2 * ||dy_c||**2``.

    The second part, ``xh * mean(dy * e)``, is one random number per channel times ``xh``,
    and ``xh`` is made from the producing convolution's input: in that convolution's weight
    gradient it adds up coherently over the ``M`` positions, to about
    ``V * g**2 * s**4 * ||dy_c||**2 * Var(conv input)`` per channel (white inputs).
    """
    if grad_gamma is None or "dy_channel" not in use or use.get("gx", 0.0) <= 0:
        return None
    gamma, invstd, count, dy_c = use["gamma"], use["invstd"], use["count"], use["dy_channel"]
    if grad_gamma.numel() != gamma.numel() or dy_c.numel() != gamma.numel():
        return None
    m = grad_gamma / count
    injected = float((gamma.square() * invstd.pow(4) * (count * m.square() + dy_c / count)).sum())
    direct = float((invstd.square() * dy_c).sum())
    coherent = 0.0
    if use.get("input_var") is not None:
        coherent = float((gamma.square() * invstd.pow(4) * dy_c).sum()) * use["input_var"]
    return injected * upstream / use["gx"] + direct + coherent


def _non_channel_dims(t: torch.Tensor) -> tuple[int, ...]:
    return (0, *range(2, t.dim()))


def _squared_norm(t: torch.Tensor) -> float:
    """``sum(t**2)`` in float32 without a temporary (30x faster than ``square().sum()`` here). O(numel)."""
    return float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)) ** 2


def _hook_channel_norms(t: torch.Tensor, into: dict[str, Any], key: str) -> None:
    def hook(grad: torch.Tensor) -> None:
        into[key] = torch.linalg.vector_norm(grad.detach(), dim=_non_channel_dims(grad), dtype=torch.float32).square()

    t.register_hook(hook)


def _hook_norm(t: torch.Tensor, into: dict[str, Any], key: str) -> None:
    def hook(grad: torch.Tensor) -> None:
        value = _squared_norm(grad)
        into[key] = into.get(key, 0.0) + value if math.isfinite(value) else into.get(key, 0.0)

    t.register_hook(hook)


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (list, tuple)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return shares_storage(a, b)
    except RuntimeError:  # a tensor without readable storage (a fake or meta one)
        return False


def _matmul_role(call: OpCall, x: torch.Tensor) -> tuple[int, torch.Tensor | None] | None:
    """(contraction length, the other operand) when ``call`` multiplies ``x`` by something, else None."""
    name = call.name
    if name not in MATMUL_FUNCTIONS:
        return None
    tensors = [a for a in call.args if isinstance(a, torch.Tensor)]
    if name in ("addmm", "baddbmm"):
        tensors = tensors[1:3]
    if len(tensors) < 2:
        return None
    first, second = tensors[0], tensors[1]
    if name == "linear":
        return (first.shape[-1], second) if _same_data(x, first) else None
    if name.startswith("conv"):
        return (second[0].numel(), second) if _same_data(x, first) else None
    if name == "__rmatmul__":
        first, second = second, first
    if _same_data(x, first) and first.dim() >= 1:
        return first.shape[-1], second
    if _same_data(x, second) and second.dim() >= 2:
        return second.shape[-2], first
    # matmul may save a reshaped copy of an operand (a batched product of permuted tensors)
    if x.numel() == first.numel() and first.dim() >= 1 and x.shape[-1] == first.shape[-1]:
        return first.shape[-1], second
    if x.numel() == second.numel() and second.dim() >= 2 and x.dim() >= 2 and x.shape[-2] == second.shape[-2]:
        return second.shape[-2], first
    return None
