"""Finding the largest batch that fits, given a probe that says whether one batch size fits.

Pure logic (the probe is a callable), so the search is tested without training anything.

>>> found = largest_fitting(lambda b: (b <= 300, 100 + b), start=16, cap=400, resolution=0.1)
>>> found.batch, found.failed_at   # 291 fits, 320 does not: a gap within 10% of 291
(291, 320)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["SearchResult", "largest_fitting"]


@dataclass
class SearchResult:
    """The largest batch found to fit (0: not even ``start``... halved down to 1), the smallest
    found not to fit (None: never reached), and every probe in order as ``(batch, fits)``."""

    batch: int
    failed_at: int | None
    probes: list[tuple[int, bool]] = field(default_factory=list)


def largest_fitting(fits: Callable[[int], tuple[bool, float | None]], start: int, cap: float,
                    resolution: float = 0.1, limit: int = 1 << 16) -> SearchResult:
    """Growth from ``start`` until a batch does not fit, then bisection until the gap between the
    largest fit and the smallest failure is at most ``resolution`` of the fit (or 1). If ``start``
    does not fit, halves down to 1 first. ``limit`` bounds the growth.

    ``fits(batch)`` returns (whether it fits, the peak memory it used or None). Probes near the
    cap are the slow ones, so growth aims just under the batch that a straight line through the
    last two fitting peaks predicts for ``cap`` (at most 4x, at least 2x while far from it)."""
    if start < 1 or not 0 < resolution < 1:
        raise ValueError(f"start must be >= 1 and resolution in (0, 1), got {start}, {resolution}")
    probes: list[tuple[int, bool]] = []
    peaks: list[tuple[int, float]] = []

    def probe(batch: int) -> bool:
        ok, peak = fits(batch)
        probes.append((batch, ok))
        if ok and peak is not None:
            peaks.append((batch, peak))
        return ok

    low, high = 0, None
    batch = start
    if probe(batch):
        low = batch
        while batch < limit:
            batch = min(_next_batch(batch, peaks, cap, resolution), limit)
            if not probe(batch):
                high = batch
                break
            low = batch
    else:
        high = batch
        while batch > 1:
            batch //= 2
            if probe(batch):
                low = batch
                break
            high = batch
    while high is not None and low > 0 and high - low > max(1, int(low * resolution)):
        middle = (low + high) // 2
        if probe(middle):
            low = middle
        else:
            high = middle
    return SearchResult(low, high, probes)


def _next_batch(batch: int, peaks: list[tuple[int, float]], cap: float, resolution: float) -> int:
    """Double, or jump to 97% of the batch a line through the last two fitting peaks predicts
    (at least ``2 * resolution`` further, so that a close prediction ends the growth in one probe)."""
    if len(peaks) < 2 or peaks[-1][0] == peaks[-2][0]:
        return batch * 2
    (b0, p0), (b1, p1) = peaks[-2], peaks[-1]
    slope = (p1 - p0) / (b1 - b0)
    if slope <= 0:
        return batch * 4
    predicted = b1 + (cap - p1) / slope
    return int(min(max(predicted * 0.97, batch * (1 + 2 * resolution), batch + 1), batch * 4))
