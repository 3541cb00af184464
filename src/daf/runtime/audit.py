"""The gradient audit: now and then, the gradient of a slice of the batch taken exact and compressed, compared.

Every ``Audit.every`` training forwards of a wrapped model (and the first, with ``Audit.first``), before the
forward runs, ``GradientAudit.step`` takes the first ``Audit.fraction`` of the batch (at least
``Audit.min_samples``) and computes, twice from the same random state, the gradient over the trainable parameters of ``<c, output>`` for a fixed random
cotangent ``c`` per output tensor: once with DAF's hooks stepped aside (exact), once through a session of its
own with the main session's policy and raised widths (compressed, its sites named as the main session's).
Buffers (batch norm statistics) and the random state are put back after each pass, and ``.grad`` is never
touched (``torch.autograd.grad``). Below ``Audit.threshold`` (cosine over all parameters) the saves whose codes
erred most get the next width (1 -> 2 -> 4 -> 8 -> raw) in the main session (``Session.raise_bits``), and
the slice is audited again, at most ``MAX_ROUNDS`` times. Still below then, every stored save gets its next
width, round after round, until the threshold holds or nothing is coded any more: a model whose gradient
the codes cannot keep is trained raw, said in the warning, rather than silently wrong (a Mamba with large
channels: one save kind, the recurrent state that ``dA``'s gradient multiplies, spoilt it at 4 bits while
its codes erred no more than the others'). Cost: two to five forward and backward passes of the slice per
audit, up to four more where the targeted raises fail (docs/audit.md).

DAF does not know the user's loss: the random cotangent on the model's output stands in for it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from daf.config import Audit, stochastic_at
from daf.policy import Policy
from daf.runtime.records import Saved
from daf.runtime.session import Session

__all__ = ["GradientAudit", "AuditResult", "MAX_ROUNDS", "WIDER"]

MAX_ROUNDS = 3  # targeted raises per audit: 1 -> 8 bits takes three
WIDER = {1: 2, 2: 4, 4: 8, 8: 0}  # the next width of a raised save; 0: kept raw
_COTANGENT_SEED = 0x5EED
_WORST = 3  # parameter groups the report names
_TINY_GROUP = 1e-6  # groups with less of the exact gradient's squared norm are left out of the worst (noise)


@dataclass
class AuditResult:
    """One audit: the forward it ran before, the samples audited, the cosine of the first and the last
    round (None: the exact gradient was zero), the worst parameter groups (module paths) of the last
    round, the widths raised as (site, from, to), and whether every stored save had to be raised."""

    forward: int
    samples: int
    before: float | None
    after: float | None
    worst: list[tuple[str, float]] = field(default_factory=list)
    raised: list[tuple[str, int, int]] = field(default_factory=list)
    broad: bool = False  # the targeted raises did not reach the threshold: every stored save was raised
    threshold: float = 0.0  # the one that applied (``Audit.threshold``, or ``nearest_threshold``)


class GradientAudit:
    """The audit of one wrapped model (``daf.api`` owns it beside the session); nothing is global.

    ``step`` is called by the attachment at the start of each training forward of the root; ``running`` is
    true on the thread running the audit's own passes, which DAF's hooks then leave alone.
    """

    def __init__(self, session: Session, config: Audit) -> None:
        self.session, self.config = session, config
        self.forwards = self.audits = 0
        self.last: AuditResult | None = None
        self.off: str | None = None  # why the audit stopped, if it did
        self._codecs = session.codecs  # taken now: a benchmark may wrap the session's in timers later
        self._config = session.config.replace(background=False, budget=None)  # the slice's own session
        self._local = threading.local()
        self._lock = threading.Lock()  # one audit at a time: the random state is the process's
        self._warned = False
        session.sections["audit"] = self.summary

    @property
    def running(self) -> bool:
        return getattr(self._local, "running", False)

    def step(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> AuditResult | None:
        """Count a training forward of ``model`` about to run on ``args``/``kwargs``; audit it if due."""
        if self.off is not None or self.running:
            return None
        self.forwards += 1
        every, index = self.config.every, self.forwards - 1
        due = index % every == 0 if self.config.first else index > 0 and index % every == 0
        if not due or not self._lock.acquire(blocking=False):
            return None
        try:
            return self._audit(model, args, kwargs)
        except Exception as error:  # the audit must never stop training
            self._stop(f"it raised {type(error).__name__}: {error}")
            return None
        finally:
            self._lock.release()

    def _audit(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> AuditResult | None:
        batch = _batch_size(args, kwargs)
        if batch is None:
            self._stop("no tensor argument has a batch dimension to slice")
            return None
        samples = min(batch, max(self.config.min_samples, int(self.config.fraction * batch)))
        args, kwargs = _sliced((args, kwargs), batch, samples)
        params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not params:
            return None  # nothing trains: nothing to audit
        with self._stepping_aside(), _Restoring(model) as state:
            exact = self._gradient(model, args, kwargs, params, state, None)
            if exact is None:
                self._stop("the model's output holds no floating-point tensor with autograd history")
                return None
            config = self._config.replace(min_numel=_slice_min_numel(self._config.min_numel, samples, batch))
            result = self._rounds(model, args, kwargs, params, state, config, exact, samples)
        self.audits += 1
        self.last = result
        if result.raised and not self._warned:
            self._warned = True
            warnings.warn(_raised_warning(result, result.threshold), stacklevel=_caller_level())
        return result

    def _rounds(self, model: nn.Module, args: tuple, kwargs: dict[str, Any], params: list, state: "_Restoring",
                config: Any, exact: list, samples: int) -> AuditResult:
        """Compressed passes until the cosine reaches the threshold: ``MAX_ROUNDS`` raises of the costliest
        saves, then broad rounds (``_broad``) until none is coded."""
        names = [name for name, _ in params]
        result = AuditResult(self.session.forwards, samples, None, None)
        round_, suspects = 0, set()
        while True:
            errors: dict[str, tuple[int, float]] = {}
            measured = _Measured(config, self._codecs, self.session, errors)
            compressed = self._gradient(model, args, kwargs, params, state, measured)
            cosine, result.worst = _compare(names, exact, compressed)
            result.after = cosine
            if round_ == 0:  # the threshold is the config's as the policy gave it: raises do not move it
                result.before, result.threshold = cosine, self._threshold(errors, config.rounding)
            if cosine is None or cosine >= result.threshold:
                break
            if round_ < MAX_ROUNDS:
                chosen = _costliest(errors)
                suspects.update(site for site, _ in chosen)
            else:
                chosen, suspects = _broad(errors, suspects)
            if not chosen or round_ == MAX_ROUNDS + len(WIDER) + 1:  # the cap: a width the raises do not reach
                break
            round_ += 1
            result.broad = round_ > MAX_ROUNDS
            for site, bits in chosen:
                self.session.raise_bits(site, WIDER[bits])
                result.raised.append((site, bits, WIDER[bits]))
        return result

    def _threshold(self, errors: dict[str, tuple[int, float]], rounding: str) -> float:
        """``Audit.nearest_threshold`` where every save the slice codes is rounded to nearest (a bias, the same
        every step), else ``Audit.threshold`` (stochastic rounding's noise averages out over steps)."""
        nearest = bool(errors) and not any(stochastic_at(rounding, bits) for bits, _ in errors.values())
        return max(self.config.threshold, self.config.nearest_threshold) if nearest else self.config.threshold

    def _gradient(self, model: nn.Module, args: tuple, kwargs: dict[str, Any], params: list,
                  state: "_Restoring", session: "_Measured | None") -> list | None:
        """The parameters' gradients of one pass on the slice: exact (``session`` None) or compressed through
        ``session``, which notes each stored save's (bits, relative squared error). None: nothing differentiable."""
        state.restore()
        handles = session.sites.attach(model) if session is not None else []
        try:
            with session if session is not None else contextlib.nullcontext():
                output = _forward(model, args, kwargs, session)
                outputs = _objective(_differentiable(output))
                if not outputs:
                    return None
                return list(torch.autograd.grad(outputs, [p for _, p in params], _cotangents(outputs),
                                                allow_unused=True))
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def _stepping_aside(self) -> Iterator[None]:
        self._local.running = True
        try:
            yield
        finally:
            self._local.running = False

    def _stop(self, why: str) -> None:
        self.off = why
        warnings.warn(f"DAF's gradient audit is off for this model: {why}. Training goes on compressed, "
                      f"unaudited; daf.Config(audit=daf.Audit(every=0)) turns the audit off without this warning "
                      f"(docs/audit.md).", stacklevel=_caller_level())

    def summary(self) -> dict[str, Any]:
        """The report's ``audit`` section: audits so far and the last one's figures."""
        out: dict[str, Any] = {"audits": self.audits, "every": self.config.every}
        last = self.last
        if last is not None:
            out.update(forward=last.forward, samples=last.samples, cosine=last.after, first_cosine=last.before,
                       threshold=last.threshold, worst="; ".join(f"{name} {cosine:.4f}" for name, cosine in last.worst))
        if self.session.raised:
            out["raised"] = ", ".join(f"{site}:{bits or 'raw'}" for site, bits in sorted(self.session.raised.items()))
        if self.off is not None:
            out["off"] = self.off
        return out


class _Reader(Policy):
    """The main session's policy as the audit's session sees it: its widths, none of its watching."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.codes_nonzeros_only = policy.codes_nonzeros_only

    def bits_for(self, site: str, x: torch.Tensor) -> int:
        return self._policy.bits_for(site, x)

    def bits_for_call(self, site: str, x: torch.Tensor, op: Any) -> int:
        # The call decides Auto's widths (a CNN's feature maps at 2 bits): without it the audit measured
        # 4-bit codes where the step stored 2 (MobileNetV2: 0.98 audited, 0.79 true)
        return self._policy.bits_for_call(site, x, op)

    def reason(self, x: torch.Tensor, op: Any) -> str:
        return self._policy.reason(x, op)

    def choice(self, site: str, x: torch.Tensor, op: Any) -> tuple[int, str]:
        return self._policy.choice(site, x, op)


class _Measured(Session):
    """A session for one compressed pass of the audit: the main session's policy (read only) and raised widths
    (shared), and per stored save the relative squared error of its codes, ``|decoded - x|^2 / |x|^2``."""

    def __init__(self, config: Any, codecs: Any, main: Session, errors: dict[str, tuple[int, float]]) -> None:
        super().__init__(config, codecs, _Reader(main.policy))
        self.raised = main.raised  # the same dict: widths raised in one round hold in the next
        self.errors = errors

    def pack(self, tensor: torch.Tensor) -> Any:
        saved = super().pack(tensor)
        if isinstance(saved, Saved) and saved.bits and not saved.exact and saved.site not in self.errors:
            decoded, x = self.unpack(saved).float(), tensor.detach().float()
            error = float((decoded - x).square().sum() / x.square().sum().clamp_min(1e-30))
            self.errors[saved.site] = (saved.bits, error)
        return saved


class _Restoring:
    """The random state (CPU, and CUDA's if it is in use) and every buffer of ``model`` as they were on
    entry; ``restore`` puts them back (before each pass, and on exit)."""

    def __init__(self, model: nn.Module) -> None:
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        with torch.no_grad():
            for buffer, value in self._buffers:
                buffer.copy_(value)

    def __enter__(self) -> "_Restoring":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _forward(model: nn.Module, args: tuple, kwargs: dict[str, Any], session: Session | None) -> Any:
    if session is None:
        return model(*args, **kwargs)
    session.begin_forward(model)
    try:
        with session.hooks():
            return model(*args, **kwargs)
    finally:
        session.end_forward()


def _broad(errors: dict[str, tuple[int, float]], suspects: set[str]) -> tuple[list[tuple[str, int]], set[str]]:
    """A broad round's raises, and the suspects left: while the coded saves differ in width, those at the fewest
    bits (every save comes to the widest's width before any goes further); once all are at one width, first
    the saves the targeted rounds raised (the suspects), then all of them. Raising every save by a width at
    once sent those the targeted rounds had brought to 8 bits on to raw while the rest went 4 -> 8: T5 with
    large channels ended at 1.3x where every save at 8 bits keeps its gradient (0.9986, 4.7x). A Mamba with
    large channels needs its recurrent state raw, which a targeted round had raised: the suspects go raw
    before the rest (0.997 at 2.3x, where all raw is 1.0x)."""
    if not errors:
        return [], suspects
    widths = {bits for bits, _ in errors.values()}
    least = min(widths)
    if len(widths) == 1 and suspects & errors.keys():
        return [(site, bits) for site, (bits, _) in errors.items() if site in suspects], set()
    return [(site, bits) for site, (bits, _) in errors.items() if bits == least], suspects


def _slice_min_numel(min_numel: int, samples: int, batch: int) -> int:
    """``Config.min_numel`` scaled to the slice, so that the slice codes the saves the step codes: at the
    step's own, a MobileNetV2's late feature maps (a few thousand elements per sample) were kept raw in a
    one-sample slice and never raised, while the step stored them at 2 bits (slice 0.997, step 0.82)."""
    return min_numel if min_numel == 0 else max(1, math.ceil(min_numel * samples / batch))


def _batch_size(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The first dimension of the first tensor argument (positional, then keyword), if it has one."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.dim() else None
    return None


def _sliced(value: Any, batch: int, samples: int) -> Any:
    """``value`` with every tensor whose first dimension is ``batch`` cut to its first ``samples`` (through
    tuples, lists and dicts); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value[:samples] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_sliced(v, batch, samples) for v in value) if type(value) in (tuple, list) else value
    if isinstance(value, dict) and type(value) is dict:
        return {k: _sliced(v, batch, samples) for k, v in value.items()}
    return value


def _differentiable(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors with autograd history in ``output`` (tensors, tuples, lists, dicts and
    dict subclasses such as Hugging Face's ``ModelOutput``), in order."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() and output.grad_fn is not None else []
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for v in values for t in _differentiable(v)]


def _objective(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the audit differentiates: the scalars among ``outputs`` where there are any (a loss the model
    returns, as a Hugging Face model given labels does: the gradient the step will take), else all of them.
    A T5 with large channels returns its loss beside the logits; with random cotangents on those too, the
    audit's slice was at cosine 0.990 where the loss's gradient, on the same samples and widths, was at 0.970."""
    losses = [t for t in outputs if t.dim() == 0]
    return losses or outputs


def _cotangents(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fixed random cotangent per output (the same every pass); a scalar (a loss) gets 1."""
    generator = torch.Generator().manual_seed(_COTANGENT_SEED)
    return [torch.ones_like(t) if t.dim() == 0 else
            torch.randn(t.shape, generator=generator).to(device=t.device, dtype=t.dtype) for t in outputs]


def _compare(names: list[str], exact: list, compressed: list) -> tuple[float | None, list[tuple[str, float]]]:
    """Cosine of the two gradients over all parameters, and the ``_WORST`` parameter groups (the module
    owning the parameter) by their own cosine."""
    groups: dict[str, list[int]] = {}
    terms = []
    for name, e, c in zip(names, exact, compressed):
        if e is None or c is None:
            continue
        groups.setdefault(name.rpartition(".")[0] or name, []).append(len(terms))
        e, c = e.detach().float().flatten(), c.detach().float().flatten()
        terms.append(torch.stack([e.dot(c), e.dot(e), c.dot(c)]))
    if not terms:
        return None, []
    sums = torch.stack(terms).cpu().tolist()  # one transfer for all parameters
    total = _cosine([sum(column) for column in zip(*sums)])
    exact_norm = sum(row[1] for row in sums)
    ranked = []
    for group, rows in groups.items():
        figures = [sum(sums[i][j] for i in rows) for j in range(3)]
        cosine = _cosine(figures)
        if cosine is not None and figures[1] >= _TINY_GROUP * exact_norm:
            ranked.append((cosine, group))
    return total, [(group, cosine) for cosine, group in sorted(ranked)[:_WORST]]


def _cosine(figures: list[float]) -> float | None:
    """None where the exact gradient is zero or not finite (nothing to judge DAF by); 0 where only the
    compressed one is not finite."""
    dot, ee, cc = figures
    if not math.isfinite(ee) or ee <= 0:
        return None
    if not (math.isfinite(dot) and math.isfinite(cc)) or cc <= 0:
        return 0.0
    return dot / math.sqrt(ee * cc)


def _costliest(errors: dict[str, tuple[int, float]]) -> list[tuple[str, int]]:
    """The saves that erred most, largest first, until they hold half the summed error: (site, bits)."""
    ranked = sorted(errors.items(), key=lambda item: -item[1][1])
    total, covered, chosen = sum(e for _, (_, e) in ranked), 0.0, []
    for site, (bits, error) in ranked:
        if chosen and covered >= total / 2:
            break
        chosen.append((site, bits))
        covered += error
    return chosen


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside DAF and torch: the user's call of the model."""
    skip = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


_NAMED = 8  # raises the warning names; the report has them all


def _raised_warning(result: AuditResult, threshold: float) -> str:
    named = [f"{site} {old}->{new or 'raw'}" for site, old, new in result.raised[:_NAMED]]
    more = len(result.raised) - len(named)
    raised = ", ".join(named) + (f" and {more} more" if more else "")
    if result.broad:
        raised += (" (raising the saves whose codes erred most did not reach the threshold, so every stored save "
                   "was raised, as far as raw where that was needed)")
    after = "unknown" if result.after is None else f"{result.after:.4f}"
    still = "" if result.after is not None and result.after >= threshold else " (still below: more may follow)"
    return (f"DAF's gradient audit (forward {result.forward}, {result.samples} samples): the compressed gradient's "
            f"cosine to the exact one was {result.before:.4f}, under the threshold {threshold}; it raised the "
            f"widths of {raised} (bits); cosine now {after}{still}. Later raises are in "
            f"daf.report(model).sections['audit'] (said once per wrapped model; docs/audit.md).")
