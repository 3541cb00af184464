"""The adaptive bit policy: bits per site from measured importance, re-planned every N steps.

Forward 0 runs every site at the allowed width nearest the average (ties up: 2 for an
average of 1.5, 2.0 or 2.5) while the importance estimator watches: for that one step an
average below 2 is exceeded, because 1 bit everywhere wrecks the gradient (MiniLM's
relative gradient error was ~1e8). The first plan is made at forward 1, from what forward
and backward 0 measured, and a new one every ``replan_every`` forwards. Between plans
the estimator only watches the ``window`` forwards before the next plan, so steady
state costs nothing but the dictionary look-up of ``bits_for``.

A plan replaces uniform bits (when those fit the budget) only if its estimated variance is
at least ``min_gain`` (25%) below theirs: the estimates are good to a factor of 2-3 per
site, so a smaller predicted gain is not worth the bet (ResNet-18 with ReLU masks: even
the per-site optimum measured by leave-one-in runs is only 0.7% better than uniform 2).

Only the sites whose estimate is checked are traded: products with a parameter and BatchNorm inputs.
A site the estimator costs by its generic model (a norm, an activation, softmax, an attention
product: ``SiteStats.generic``) is held at the uniform width, because leave-one-in puts that model
50-100x too high at the median on transformers, and a plan that bought bits for such sites lost to
uniform bits on BERT, Llama and ViT (issue 16; ``generic`` = "floor" / "trade" for the alternatives).

Budget: over the sites the plan covers (the tensors quantized by the codec), the
size-weighted mean of the bits is at most ``Adaptive.average``, sizes counted in whole
groups (what the payload holds). A site may be kept raw: it then counts at its
dtype's bits (32 for float32), honestly, and only where it fits the budget. A ReLU
output saved by a later op stores codes for its nonzeros only (``codes_nonzeros_only``;
its zeros come from ReLU's exact mask): it counts all its elements in the average and
buys bits for the nonzeros alone (``Site.elements``, docs/policy.md section 3a). Exact
1-bit masks (ReLU outputs, dropout masks) are stored alike by every policy and are
outside the average; the report lists them as their own rows; so are the saves remade from other
records (a norm's or activation's output, attention's output: ``daf.runtime.derived``), which store
nothing under either. So are the saves that a rule above every
policy holds at more bits (softmax probabilities at 4, what backward exponentiates at 8:
``daf.policy.exponent_guard``): they are left out of the plan (``floors`` in the summary), since uniform
bits pay for them alike and cutting the traded sites to pay for them lost to uniform on GPT-2 and Llama.
"""

from __future__ import annotations

from typing import Any

import torch

from daf.config import ALLOWED_BITS, GENERIC_MODES, Adaptive
from daf.policy.allocator import RAW_BITS, Plan, Site, allocate
from daf.policy.importance import ImportanceEstimator
from daf.policy.uniform import Policy
from daf.tracing import OpCall

__all__ = ["AdaptivePolicy", "GENERIC_MODES"]


class AdaptivePolicy(Policy):
    """Bits per site minimizing the estimated gradient variance at an average of ``average`` bits.

    ``bits_for`` is O(1); a re-plan costs O(sites * 5 * cells) (``daf.policy.allocator``).
    """

    codes_nonzeros_only = True

    def __init__(self, average: float, group_size: int = 256, replan_every: int = 50,
                 choices: tuple[int, ...] = ALLOWED_BITS, allow_raw: bool = True, window: int = 4,
                 smoothing: float = 0.7, min_gain: float = 0.25, generic: str = "hold") -> None:
        # the knobs are those of daf.Adaptive, checked there: one set of rules and messages
        Adaptive(average=average, replan_every=replan_every, window=window, smoothing=smoothing,
                 min_gain=min_gain, allow_raw=allow_raw, generic=generic)
        self.average = float(average)
        self.group_size = group_size
        self.replan_every = replan_every
        self.choices = tuple(sorted(choices))
        self.allow_raw = allow_raw
        self.window = window
        self.min_gain = min_gain
        # a site costed by the estimator's generic model (``SiteStats.generic``): "hold" keeps it at the
        # uniform width, neither cut nor raised; "floor" may raise it, never cut it; "trade" trades it like
        # the others (the plans before issue 16)
        self.generic = generic
        self.held: list[str] = []  # sites of the last plan held at the uniform width (generic, unsure estimate)
        self.estimated_gain: float | None = None
        self.fallback: str | None = None  # why the last plan is uniform bits instead of the allocator's, if it is
        # nearest allowed width (ties up): a first step at 1 bit everywhere wrecks the gradient
        self.default_bits = min(self.choices, key=lambda b: (abs(b - self.average), -b))
        self.estimator = ImportanceEstimator(group_size, self.choices, smoothing)
        self.plan: Plan | None = None
        self.plans = 0
        self._step = 0
        self._credit = 0  # element-bits the planned sites of this forward left unused so far
        self._watching = True
        self._importance: dict[str, float] = {}
        self._given: dict[str, int] = {}  # what bits_for last gave each site
        # sites a rule above every policy raised (daf.policy.exponent_guard: softmax probabilities, what
        # backward exponentiates), and to what: outside the plan and its budget, as exact masks are
        self.floors: dict[str, int] = {}
        # sites remade from other records (daf.runtime.derived): they store nothing under uniform bits
        # too, so the plan neither pays for them nor raises them (a raise would store codes that uniform
        # bits do not: T5 stored 3% more than uniform 2 when the plan raised its norms' outputs)
        self.derived: set[str] = set()
        self._replan_due = False

    # -- the Policy interface ----------------------------------------------------------------
    def on_forward_start(self, step: int) -> None:
        self._step = step
        self._credit = 0
        self.estimator.begin_step()
        if step >= 1 and (self.plan is None or step % self.replan_every == 0 or self._replan_due):
            self._replan_due = False
            self.replan()
        until_next = self.replan_every - step % self.replan_every
        self._watching = self.plan is None or until_next <= self.window

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        """The plan's bits for ``site``; fewer if ``x`` has grown past the element-bits the plan gave it
        plus what the sites before it in this forward left unused (the nonzeros of a ReLU output vary
        from step to step). So the planned sites never store more than the plan, at every step."""
        bits = self._planned_bits(site, x)
        self._given[site] = bits
        return bits

    def _planned_bits(self, site: str, x: torch.Tensor) -> int:
        if self.plan is None:
            return self.default_bits
        bits = self.plan.bits.get(site)
        if bits is None:
            return self.default_bits
        if bits > max(self.choices):
            return 0
        available = self.plan.sizes.get(site, 0) * bits + self._credit
        stored = -(-x.numel() // self.group_size) * self.group_size
        while stored * bits > available and bits > self.choices[0]:
            bits = max(b for b in self.choices if b < bits)
        self._credit = max(0, available - stored * bits)
        return bits

    def watch(self, site: str, x: torch.Tensor, bits: int, elements: int | None = None, derived: bool = False) -> None:
        if derived:
            self.derived.add(site)
        else:
            # Coded after all (a remake is declined when the plan gives its records too few bits): the plan
            # left it out, so it would stay at the default width outside the budget; plan again next forward.
            if site in self.derived:
                self.derived.discard(site)
                self._replan_due = True
            if bits > self._given.get(site, bits):  # raised above what the policy gave: a rule's floor
                self.floors[site] = bits
        if self._watching:
            self.estimator.observe_tensor(site, x, elements)

    def watch_op(self, call: OpCall) -> None:
        if self._watching:
            self.estimator.observe_call(call)

    def importance(self, site: str, order: int) -> float:
        """The marginal cost of demoting the site: estimated variance added per element-bit saved.

        The allocator trades on the same slope, so the page pool demotes and spills first
        the records whose bits the plan would also have cut first. Sites without an
        estimate rank by pack order, below every estimated one.
        """
        value = self._importance.get(site)
        return float(order) * 1e-30 if value is None else value

    def summary(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"policy": "adaptive", "average_bits": self.average, "plans": self.plans,
                                   "replan_every": self.replan_every}
        if self.plan is None:
            figures["bits"] = f"{self.default_bits} everywhere until the first plan"
            return figures
        counts: dict[str, int] = {}
        for b in self.plan.bits.values():
            key = "raw" if b > max(self.choices) else f"{b}bit"
            counts[key] = counts.get(key, 0) + 1
        if self.estimated_gain is not None:
            figures["estimated_gain_over_uniform"] = round(self.estimated_gain, 4)
        figures["uniform_fallback"] = self.fallback
        if self.held:
            figures["held_at_uniform"] = {"sites": len(self.held), "mode": self.generic, "why": (
                "costed by the generic model (a non-parameter consumer: norm, activation, softmax, "
                "attention product), whose estimate is unsure; never below the uniform width"
                + ("" if self.generic == "floor" else ", nor above"))}
        figures.update(floors=dict(self.floors), derived_outside_plan=len(self.derived), mean_bits=round(self.plan.mean_bits, 4),
                       estimated_variance=self.plan.cost,
                       exact=self.plan.exact, sites=counts, plan=dict(self.plan.bits))
        return figures

    def close(self) -> None:
        """Remove the parameter hooks and stop watching: a forward after this puts no new ones.

        Hooks on a step's intermediate tensors have no handle; they go with the autograd graph
        and only fill in figures no plan reads any more.
        """
        self._watching = False
        self.estimator.close()

    # -- planning ----------------------------------------------------------------------------
    def replan(self) -> Plan | None:
        """Solve the allocation from the current estimates; sites without one keep the default bits, and
        so do the sites the estimator costs by its generic model (``_held_width``)."""
        sites, full = [], []
        fixed_elements = fixed_bits = 0
        held_bits = self._held_width()
        self.held = []
        for name, stats in self.estimator.sites.items():
            size = -(-stats.numel // self.group_size) * self.group_size
            elements = max(size, -(-stats.elements // self.group_size) * self.group_size)
            costs = self.estimator.costs(name)
            if size == 0:
                continue
            if name in self.floors or name in self.derived:  # a rule's bits, or remade: nothing to trade
                continue
            if costs is None:
                fixed_elements += elements
                fixed_bits += size * self.default_bits
                continue
            if self.allow_raw and elements == size:  # raw keeps every element, zeros too
                costs[stats.dtype_bits if stats.dtype_bits > max(self.choices) else RAW_BITS] = 0.0
            full.append(Site(name, size, costs, elements))
            if held_bits is not None and stats.generic:
                self.held.append(name)
                floor = self.generic == "floor"
                costs = {b: c for b, c in costs.items() if b == held_bits or (floor and b > held_bits)}
            sites.append(Site(name, size, costs, elements))
        if not sites:
            return None
        total = sum(s.elements for s in sites) + fixed_elements
        # sites without an estimate keep the default bits; the rest share what is left
        average = (self.average * total - fixed_bits) / (total - fixed_elements)
        plan, self.fallback = self._guard(allocate(sites, max(average, min(self.choices))), sites, average)
        self.plan = plan
        self.plans += 1
        self._importance = _slopes(full, plan, max(self.choices))
        # the pool demotes in importance order: what a rule holds goes last
        self._importance.update((name, float("inf")) for name in self.floors)
        return plan

    def _held_width(self) -> int | None:
        """The width of the sites whose estimate is the generic model's, or None where they are traded.

        The uniform width (the default, when it fits the average): the plan then never gives such a
        site fewer bits than uniform would, nor spends the budget raising it on an estimate that
        leave-one-in puts 50-100x too high at the median on transformers (docs/policy.md section 1). Below the
        default (an average of 1.5) uniform is 1 bit, where these sites' errors compound: they are
        traded then, at their compounding 1-bit cost (``COMPOUNDING``).
        """
        if self.generic == "trade" or self.default_bits > self.average:
            return None
        return self.default_bits

    def _guard(self, plan: Plan, sites: list[Site], average: float) -> tuple[Plan, str | None]:
        """``plan``, or uniform bits where the estimates cannot back it, and why (None: the plan stands).

        The uniform reference is the default width when it fits the budget, else the widest that does
        (fewer bytes than the budget). Uniform bits replace the plan when the plan's estimated gain over
        them is below ``min_gain`` (each site's estimate is good to a factor of about 2-3, docs/policy.md,
        so a smaller predicted gain is not worth the bet), or when the estimates say nothing: every site
        costs 0 at the reference width (no measured gradient reaches them), where a plan would trade
        bits on no information (issue 13 was such a plan).
        """
        self.estimated_gain = None
        fitting = [b for b in self.choices if b <= average]
        if not fitting:
            return plan, None
        bits = self.default_bits if self.default_bits <= average else max(fitting)
        # the held sites are at ``bits`` in both: the gain is over the sites the plan trades
        held = set(self.held) if self.generic == "hold" else set()  # "floor": they may differ, so they count
        traded = [site for site in sites if site.name not in held]
        uniform = sum(site.costs[bits] for site in traded)
        planned = sum(site.costs[plan.bits[site.name]] for site in traded)
        gain = 1 - planned / uniform if uniform > 0 else 0.0
        if bits == self.default_bits:
            self.estimated_gain = gain
        if not traded:
            reason = (f"uniform {bits} bits: every site is costed by the generic model "
                      f"(a non-parameter consumer), whose estimate is unsure")
        elif uniform <= 0:
            reason = f"uniform {bits} bits: every site's estimated cost at {bits} bits is 0 (nothing to plan on)"
        elif bits == self.default_bits and gain < self.min_gain:
            reason = f"uniform {bits} bits: the plan's estimated gain {gain:.3f} is below min_gain {self.min_gain}"
        else:
            return plan, None
        return _plan_of({site.name: bits for site in sites}, sites, self.average), reason


def _plan_of(bits: dict[str, int], sites: list[Site], average: float) -> Plan:
    total = sum(s.elements for s in sites)
    return Plan(bits, sum(s.costs[bits[s.name]] for s in sites), sum(s.size * bits[s.name] for s in sites) / total,
                average, True, 1, {s.name: s.size for s in sites})


def _slopes(sites: list[Site], plan: Plan, widest: int) -> dict[str, float]:
    """Per site: the variance its bits buy per element-bit at its place in the plan.

    The slope to its next fewer bits; at the fewest, the slope to the next more bits (what
    the plan declined to buy); kept raw: infinite (raw tensors never enter the store anyway).
    """
    out = {}
    for s in sites:
        bits = plan.bits[s.name]
        if bits > widest:
            out[s.name] = float("inf")
            continue
        lower = [b for b in s.costs if b < bits]
        other = max(lower) if lower else min((b for b in s.costs if b > bits), default=None)
        if other is None:
            out[s.name] = 0.0
            continue
        out[s.name] = abs(s.costs[other] - s.costs[bits]) / (s.size * abs(bits - other))
    return out
