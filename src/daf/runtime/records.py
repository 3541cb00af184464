"""What autograd holds instead of a saved tensor: a record in the store (``Saved``), the tensor kept as it
is (``Kept``), and what they check when backward asks (``Source``: the tensor's version at pack time).
A remade save's records (``remake_from``) and a frozen head's input waiting to be coded (``HeadInput``)."""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from typing import Any

import torch

from daf.memory import Store
from daf.runtime.route import Remake

__all__ = ["Saved", "Kept", "Source", "Handed", "HeadInput", "NO_CHECK", "remake_from", "check_version"]


class Saved:
    """What autograd holds instead of a tensor: a reference into the store.

    The same object is returned for every op that saves the same tensor, so the
    record is released exactly once, when autograd drops the last of them. Under
    background packing ``ref`` is None and ``pending`` holds the future and the importance
    until the session puts the result into the store (and its bytes into report row ``row``). A record of
    the nonzeros of a ReLU output holds ``mask``: the ``Saved`` of ReLU's own 1-bit mask,
    kept alive with it, which says where they go and the output's shape, order and dtype.
    """

    __slots__ = ("store", "ref", "site", "pending", "mask", "source", "row", "exact", "numel", "channels_last",
                 "readers", "bits", "handed", "__weakref__")

    def __init__(self, store: Store, ref: int | None, site: str, source: "Source",
                 pending: tuple[Future, float] | None = None, mask: "Saved | None" = None) -> None:
        self.store, self.ref, self.site, self.pending, self.mask = store, ref, site, pending, mask
        self.source, self.row, self.exact, self.numel = source, -1, False, 0
        self.channels_last = False  # restored in channels-last layout (daf.runtime.layout)
        self.readers: frozenset[str] | None = None  # the ops that may share it (None: any); Codecs.readers
        self.bits = 0  # the code width it was stored at (a derived save asks whether it is fine enough)
        self.handed = Handed()  # the decoded tensor backward got last, to see a backward's in-place change

    def __del__(self) -> None:
        if self.ref is None:
            return
        try:
            self.store.release(self.ref)
        except Exception:  # interpreter shutdown: nothing left to free
            pass


class Handed:
    """A weak reference to the tensor an unpack handed to backward, and its version then. Plain autograd
    hands every reader of a save the same tensor and checks its version at each unpack, so a backward that
    changes it in place (a custom ``autograd.Function``'s) makes the next reader raise. DAF hands out a
    decoded copy (shared by the next reader through the session's cache): the same check on that copy
    raises where plain autograd would, instead of giving the next reader the changed values (or,
    decoded afresh, other values than plain's). Not seen: a change to a copy that died before the next
    unpack (holding it would keep its memory)."""

    __slots__ = ("tensor", "version")

    def __init__(self) -> None:
        self.tensor: weakref.ref | None = None
        self.version = 0

    def check(self, site: str) -> None:
        tensor = self.tensor() if self.tensor is not None else None
        if tensor is not None:
            check_version(tensor, self.version, site)

    def hand(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tensor, self.version = weakref.ref(tensor), tensor._version
        return tensor


class HeadInput:
    """A head's input to be coded as a record when routing derives the log-probabilities from it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class NoCheck:
    """The source of a record nothing saved (a head's input): its values are what the derived save was
    made from, whatever happens to the tensor later, so there is no version to check."""

    def check(self, site: str) -> None:
        pass


NO_CHECK = NoCheck()


def remake_from(records: list[Any], function: Any, with_statistic: bool = False, rule: str = "",
                why: str = "") -> Remake | None:
    """A remake from ``records`` when each decodes to its tensor for any op (kept raw, or codes read by
    all), its bits the coarsest of them (32 for a raw one or an exact mask: an attention call's 0/-inf
    padding mask adds no error)."""
    if not all(isinstance(r, Kept) or (isinstance(r, Saved) and r.readers is None) for r in records):
        return None
    return Remake(tuple(records), function,
                  min(r.bits if isinstance(r, Saved) and not r.exact else 32 for r in records), with_statistic, rule, why)


def check_version(tensor: torch.Tensor, version: int, site: str) -> None:
    """Raise as autograd does when a tensor saved for backward was modified in place since it was saved
    (saved-tensor hooks turn autograd's own check off, so DAF makes it)."""
    if tensor._version != version:
        raise RuntimeError(
            f"DAF (site {site}): one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected "
            f"version {version} instead. Plain PyTorch raises here too: make the change after backward, or out "
            f"of place (x = x + 1 instead of x.add_(1)).")


class Source:
    """Weak references to the tensor a record was made from (and to its base, when it is a view: they share
    one version counter), and its version then. The record holds the values of pack time, but a program
    that modifies the tensor in place before backward would raise without DAF: it raises with DAF too,
    rather than train differently under DAF and without it. Through the base, a change is seen after the
    view itself is gone (``h[:, :4].relu_()`` saves the slice; ``h.add_(1)`` later)."""

    __slots__ = ("tensor", "base", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = weakref.ref(tensor), tensor._version
        base = tensor._base
        self.base = None if base is None else weakref.ref(base)

    def check(self, site: str) -> None:
        tensor = self.tensor()
        if tensor is None and self.base is not None:
            tensor = self.base()
        if tensor is not None:
            check_version(tensor, self.version, site)


class Kept:
    """A tensor autograd keeps as it is (raw, or a parameter), with its version at pack time; with
    ``channels_last`` it is handed to backward as a channels-last copy (``restores_raw_channels_last``)."""

    __slots__ = ("tensor", "version", "site", "channels_last")

    def __init__(self, tensor: torch.Tensor, site: str, channels_last: bool = False) -> None:
        self.tensor, self.version, self.site, self.channels_last = tensor, tensor._version, site, channels_last

    def unpack(self) -> torch.Tensor:
        check_version(self.tensor, self.version, self.site)
        if self.channels_last:
            return torch.empty_like(self.tensor, memory_format=torch.channels_last).copy_(self.tensor)
        return self.tensor
