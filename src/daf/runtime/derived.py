"""Saves that DAF derives instead of storing: autocast's cast of a parameter, recast in backward; a
product of a stored tensor and a stored exact mask (dropout's output), remultiplied in backward; an
activation's output whose input is stored (a gated MLP's ``silu(gate)``), recomputed in backward.

Under ``torch.autocast`` a matmul or convolution saves the bf16 (or fp16) copy of its weight, often
through a transpose. Autograd keeps the fp32 parameter alive anyway (its ``AccumulateGrad`` node holds
it), and the copy is an exact function of it: the same ``copy_`` that made it, then the same view. So
DAF keeps nothing of the copy and remakes it when backward unpacks it; the copy itself is freed after
forward (or when autocast's weight cache is cleared) instead of living until backward.

What routing checked at pack time (``daf.tracing.parameter_of_cast``) makes the recast bit-identical to
the copy. What can still change before backward is the parameter: a change in place (an optimizer step
between forward and backward) or new data put in (``param.data = ...``). Plain autograd would then
silently use the old copy under autocast, and raise without autocast (it saves the parameter itself);
DAF raises, naming the site, rather than return values that the copy never held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from daf.tracing import storage_addresses

__all__ = ["Derived", "DerivedProduct", "DerivedActivation", "DerivedAttention", "DerivedStatistic"]


class _VersionCheck(Protocol):
    def check(self, site: str) -> None: ...


class Derived:
    """A cast of ``parameter`` saved at ``site``, kept as the recipe to remake it: the view of the copy that
    was saved, and the parameter's version and storage then. ``source`` checks the saved copy itself,
    while it lives, as for every other save."""

    __slots__ = ("parameter", "version", "storage", "view", "dtype", "device", "site", "source")

    def __init__(self, tensor: torch.Tensor, parameter: torch.Tensor, site: str, source: _VersionCheck) -> None:
        self.parameter, self.version = parameter, parameter._version
        self.storage = storage_addresses(parameter)
        self.view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        self.dtype, self.device, self.site, self.source = tensor.dtype, tensor.device, site, source

    def unpack(self) -> torch.Tensor:
        self.source.check(self.site)
        self._check_parameter()
        parameter = self.parameter.detach()
        # The copy holds the parameter's elements in its memory order (parameter_of_cast checked): cast that
        # block, as Tensor.to did, and view it as the saved tensor was.
        block = parameter.as_strided((parameter.numel(),), (1,), parameter.storage_offset())
        return block.to(device=self.device, dtype=self.dtype, copy=True).as_strided(*self.view)

    def _check_parameter(self) -> None:
        parameter = self.parameter
        if parameter._version != self.version:
            what = f"was modified in place (version {parameter._version}, {self.version} at forward)"
        elif storage_addresses(parameter) != self.storage:
            what = "was given new data (parameter.data = ... or set_) since forward"
        else:
            return
        raise RuntimeError(
            f"DAF (site {self.site}): the parameter [{parameter.type()} {list(parameter.shape)}] whose "
            f"{str(self.dtype).replace('torch.', '')} copy (autocast's cast of a weight) this op saved for backward "
            f"{what}. DAF does not keep that copy: it recasts the parameter in backward, which would now give "
            f"other values than the copy forward used (plain PyTorch raises here too without autocast, and under "
            f"autocast silently uses the old copy). Change parameters after backward (loss.backward() before "
            f"optimizer.step()), or out of place.")


class DerivedProduct:
    """``(x * mask).reshape(shape)`` saved at ``site``, where ``x`` and ``mask`` are records of this session
    (dropout's output: attention's probabilities times the noise). Nothing is stored and no error is added:
    the mask is exact, so the product carries exactly the error of ``x``'s codes, as it would if it were
    computed again in backward from the same codes. The records stay alive with it."""

    __slots__ = ("x", "mask", "shape", "dtype", "site", "source", "unpack_record")

    def __init__(self, tensor: torch.Tensor, x: Any, mask: Any, site: str, source: _VersionCheck,
                 unpack_record: Callable[[Any], torch.Tensor]) -> None:
        self.x, self.mask, self.shape, self.dtype = x, mask, tuple(tensor.shape), tensor.dtype
        self.site, self.source, self.unpack_record = site, source, unpack_record

    def unpack(self) -> torch.Tensor:
        self.source.check(self.site)
        product = self.unpack_record(self.x) * self.unpack_record(self.mask)
        return product.to(self.dtype).reshape(self.shape)


class DerivedActivation:
    """``function(*records)`` saved at ``site``, where the records are this session's (SiLU's or GELU's
    input, which the activation saved first; a LayerNorm's or RMSNorm's input, ``function`` holding the
    saved statistics and weight; fused attention's q, k and v; the two operands of attention's scores,
    ``function`` holding the call's mask). Nothing is stored; backward gets
    ``function`` of the decoded records, whose error is theirs through the function (|f'| <= 1.13 for
    the activations), in place of a second set of codes of its own. The records stay alive with it."""

    __slots__ = ("records", "function", "dtype", "site", "source", "unpack_record", "readers", "bits", "__weakref__")

    def __init__(self, tensor: torch.Tensor, records: tuple[Any, ...], function: Callable[..., torch.Tensor],
                 site: str, source: _VersionCheck, unpack_record: Callable[[Any], torch.Tensor]) -> None:
        self.records, self.function, self.dtype = records, function, tensor.dtype
        self.site, self.source, self.unpack_record = site, source, unpack_record
        self.readers = None  # any op that saves the same tensor again may share it
        self.bits = 32  # the coarsest code width of what it is remade from (a remake of it asks; set by the session)

    def unpack(self) -> torch.Tensor:
        self.source.check(self.site)
        with torch.no_grad():
            return self.function(*(self.unpack_record(r) for r in self.records)).to(self.dtype)


class DerivedAttention(DerivedActivation):
    """Fused attention's output remade from the decoded q, k, v (and mask), with the logsumexp the same kernel
    call gives, kept in ``logsumexp`` for the ``DerivedStatistic`` that stands for the saved one."""

    __slots__ = ("logsumexp",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logsumexp: torch.Tensor | None = None

    def unpack(self) -> torch.Tensor:
        self.source.check(self.site)
        with torch.no_grad():
            output, self.logsumexp = self.function(*(self.unpack_record(r) for r in self.records))
        return output.to(self.dtype)


class DerivedStatistic:
    """Fused attention's logsumexp, saved raw (before the output: autograd saves it first), until the
    output of the same call is remade (``derive_from``): then it is remade with it, and the raw one is let
    go. Backward recomputes the probabilities as exp(q k^T - logsumexp); with q and k decoded from codes
    and the forward's exact logsumexp they do not sum to one, and exp turns a small shift of the logits
    into a large error of every probability (BERT with large norm channels: gradient cosine 0.12 at 8
    bits). Remade from the same decoded q and k, they are the softmax of the decoded logits."""

    __slots__ = ("kept", "whole", "site")

    def __init__(self, kept: Any) -> None:
        self.kept, self.whole, self.site = kept, None, kept.site

    def derive_from(self, whole: DerivedAttention) -> None:
        self.kept, self.whole = None, whole

    def unpack(self, remade: Callable[[DerivedAttention], torch.Tensor]) -> torch.Tensor:
        """The kept logsumexp, or the one remade with the output (``remade(whole)`` remakes it, once)."""
        if self.whole is None:
            return self.kept.unpack()
        remade(self.whole)
        return self.whole.logsumexp
