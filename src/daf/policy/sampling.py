"""What stochastic rounding costs a tensor at each bit width, measured on a sample of its groups.

An element at fraction ``p`` of its quantization step ``D`` gets an error of variance
``D**2 * p * (1 - p)``; ``rounding_variance`` evaluates that on at most ``max_groups`` evenly
spaced groups (the codec's: ``group_size`` consecutive elements in memory order). The
importance estimator takes such samples in forward (``group_sample``, a small copy) and
measures all of a step's at once (``batched_rounding_variance``): a fixed number of tensor
ops per step rather than some forty per site, which on a loaded machine each wait for a
second OpenMP thread.
"""

from __future__ import annotations

import torch

from daf.format import flatten_memory_order

__all__ = ["rounding_variance", "group_sample", "batched_rounding_variance", "strided_sample"]


def rounding_variance(x: torch.Tensor, group_size: int, choices: tuple[int, ...],
                      max_groups: int = 64) -> tuple[torch.Tensor, float]:
    """Mean per-element variance of stochastic rounding at each bit width, and ``Var(x)``, on a sample.

    x: float [*] -> (float64 [len(choices)], float). Groups are the codec's (``group_size``
    consecutive elements in memory order); at most ``max_groups`` evenly spaced whole groups
    are read. O(max_groups * group_size * len(choices)).

    >>> v, var = rounding_variance(torch.linspace(0, 1, 4096), 256, (1, 2))
    >>> bool(v[0] > 8 * v[1])
    True
    """
    sample = group_sample(x, group_size, max_groups).to(torch.float64)
    low = sample.amin(dim=1, keepdim=True)
    span = sample.amax(dim=1, keepdim=True) - low
    finite = torch.isfinite(span).view(-1)
    sample, low, span = sample[finite], low[finite], span[finite]
    out = torch.zeros(len(choices), dtype=torch.float64)
    if sample.numel() == 0:
        return out, 0.0
    for k, bits in enumerate(choices):
        step = span / ((1 << bits) - 1)
        scaled = torch.where(step > 0, (sample - low) / torch.where(step > 0, step, 1.0), 0.0)
        frac = scaled - scaled.floor()
        out[k] = float((step.square() * frac * (1 - frac)).mean())
    return out, float(sample.var()) if sample.numel() > 1 else 0.0


def group_sample(x: torch.Tensor, group_size: int, max_groups: int = 64) -> torch.Tensor:
    """A copy of at most ``max_groups`` evenly spaced whole groups of ``x`` (memory order, the codec's groups):
    float [groups, group_size] (float64 for float64 data, else float32); all of it, [1, numel], when ``x``
    is smaller than a group. O(max_groups * group_size) for dense ``x``."""
    flat, _ = flatten_memory_order(x.detach())
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = flat.numel() // group_size
    if groups == 0:
        return flat.view(1, -1).to(dtype, copy=True)
    stride = max(1, groups // max_groups)
    return flat[: groups * group_size].view(groups, group_size)[::stride][:max_groups].to(dtype, copy=True)


def batched_rounding_variance(samples: list[torch.Tensor], choices: tuple[int, ...]) -> list[tuple[torch.Tensor,
                                                                                                   float]]:
    """``rounding_variance`` of many samples of whole groups at once: per sample ``(V(b), Var)``.

    samples: float [groups_i, group_size] each. The same figures as one call per sample (rows whose
    range is not finite left out), in a fixed number of tensor ops. O(sum(groups_i) * group_size * widths).
    """
    if not samples:
        return []
    rows = torch.cat(samples).to(torch.float64)
    site = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor([s.shape[0] for s in samples]))
    n = rows.shape[1]
    low = rows.amin(dim=1, keepdim=True)
    span = rows.amax(dim=1, keepdim=True) - low
    finite = torch.isfinite(span).view(-1)
    rows = torch.where(finite.view(-1, 1), rows, 0.0)
    low, span = torch.where(finite.view(-1, 1), low, 0.0), torch.where(finite.view(-1, 1), span, 0.0)
    count = torch.zeros(len(samples), dtype=torch.float64).index_add_(0, site, finite.double())
    per_row = torch.empty(len(choices), rows.shape[0], dtype=torch.float64)
    for k, bits in enumerate(choices):
        step = span / ((1 << bits) - 1)
        scaled = torch.where(step > 0, (rows - low) / torch.where(step > 0, step, 1.0), 0.0)
        frac = scaled - scaled.floor()
        per_row[k] = (step.square() * frac * (1 - frac)).mean(dim=1)
    variance = torch.zeros(len(choices), len(samples), dtype=torch.float64).index_add_(1, site, per_row)
    variance = variance / count.clamp_min(1)
    # Var over each sample's finite rows: within-row and between-row parts (all rows have n elements)
    means, row_var = rows.mean(dim=1), rows.var(dim=1)
    mean = torch.zeros(len(samples), dtype=torch.float64).index_add_(0, site, means) / count.clamp_min(1)
    spread = torch.where(finite, (n - 1) * row_var + n * (means - mean[site]).square(), 0.0)
    data_var = torch.zeros(len(samples), dtype=torch.float64).index_add_(0, site, spread) / (n * count - 1).clamp_min(1)
    data_var = torch.where(n * count > 1, data_var, 0.0)
    return [(variance[:, i].clone(), float(data_var[i])) for i in range(len(samples))]


def strided_sample(x: torch.Tensor, sample: int = 1 << 14) -> torch.Tensor:
    """At most ``sample`` evenly strided elements of ``x`` (in memory order), as float. O(sample) for dense
    tensors (a transposed one is not copied)."""
    flat, _ = flatten_memory_order(x.detach())
    return flat[::max(1, flat.numel() // sample)].float()
