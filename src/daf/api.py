"""The public entry points: ``wrap``, ``unwrap``, ``compress`` and ``report``."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from daf.allocator.native import AllocatorStatus
from daf.allocator.native import install as install_allocator
from daf.allocator.native import status as _allocator_status
from daf.config import Config
from daf.report import Report
from daf.runtime import Session

__all__ = ["wrap", "unwrap", "compress", "report", "session_of", "allocator_status", "native_status"]

_ATTR = "_daf_attachment"


class _Attachment:
    """The hooks DAF put on one model, and the session they feed.

    The session is closed by ``unwrap`` or, failing that, when the model is garbage-collected:
    nothing else would stop its threads and remove the policy's hooks. The finalizer holds the
    session, never the model, so it does not keep the model alive.
    """

    def __init__(self, model: nn.Module, session: Session) -> None:
        self.session = session
        self._local = threading.local()  # each thread's forward enters hooks of its own (autograd's are per thread)
        self.handles = session.sites.attach(model)
        self.handles.append(model.register_forward_pre_hook(self._begin))
        self.handles.append(model.register_forward_hook(self._end, always_call=True))
        self._finalizer = weakref.finalize(model, session.close)

    @property
    def _contexts(self) -> list[Any]:
        contexts = getattr(self._local, "contexts", None)
        if contexts is None:
            contexts = self._local.contexts = []
        return contexts

    def _active(self, model: nn.Module) -> bool:
        return model.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

    def _begin(self, model: nn.Module, args: Any) -> None:
        if not self._active(model) or torch.compiler.is_compiling():
            self._contexts.append(None)
            return
        if not any(self._contexts):
            self.session.begin_forward(model)
        context = self.session.hooks()
        context.__enter__()
        self._contexts.append(context)

    def _end(self, model: nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:
            return
        context = self._contexts.pop()
        if context is not None:
            context.__exit__(None, None, None)
            if not any(self._contexts):
                self.session.end_forward()

    def detach(self) -> None:
        """Remove the hooks and close the session; records already stored stay readable for a backward
        still to come (the store frees each when autograd releases it)."""
        for handle in self.handles:
            handle.remove()
        while self._contexts:
            context = self._contexts.pop()
            if context is not None:
                context.__exit__(None, None, None)
        self._finalizer()  # closes the session once, and unregisters it from the garbage collector's finalizers


def _config(config: Config | None, overrides: dict[str, Any]) -> Config:
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"config must be a daf.Config or None, got {type(config).__name__}")
    base = config if config is not None else Config()
    return base.replace(**overrides) if overrides else base


def _session(config: Config) -> Session:
    # The allocator first: the savings reach the process only if freed temporaries' memory is reused.
    install_allocator(config.allocator)
    return Session(config)


def wrap(model: nn.Module, config: Config | None = None, **overrides: Any) -> nn.Module:
    """Compress what ``model`` saves for backward while it trains; returns the same module.

    Active while ``model`` runs forward in training mode with grad enabled; under
    ``eval()``, ``torch.no_grad()`` or ``torch.inference_mode()`` nothing changes.
    No layer is swapped: the module's type, parameters and state_dict stay as they are.

    >>> m = wrap(nn.Linear(4, 4), bits=4)
    >>> report(m).ratio
    1.0
    >>> unwrap(m) is m
    True
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"wrap takes a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model is already wrapped by DAF; call daf.unwrap(model) first to change its config")
    session = _session(_config(config, overrides))
    object.__setattr__(model, _ATTR, _Attachment(model, session))
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Remove DAF from ``model``: its hooks and its policy's gone, its worker threads stopped; what a forward
    before stored stays readable for backward, each record freed once backward no longer needs it."""
    attachment = getattr(model, _ATTR, None)
    if attachment is None:
        raise ValueError("this model is not wrapped by DAF (use daf.wrap(model) first)")
    object.__delattr__(model, _ATTR)
    attachment.detach()
    return model


def session_of(model: nn.Module) -> Session:
    """The session of a wrapped model."""
    attachment = getattr(model, _ATTR, None)
    if attachment is None:
        raise ValueError("this model is not wrapped by DAF (use daf.wrap(model) first)")
    return attachment.session


def report(model: nn.Module | Session) -> Report:
    """What the last forward of a wrapped model (or a ``compress`` session) stored."""
    session = model if isinstance(model, Session) else session_of(model)
    return session.report()


@contextlib.contextmanager
def compress(model: nn.Module | None = None, config: Config | None = None, **overrides: Any) -> Iterator[Session]:
    """Compress what is saved for backward inside the block; yields the session.

    Backward may run after the block. With ``model`` given, sites are named after
    its submodules and ``daf.report(session)`` has their paths. The block closes the
    session when it ends (hooks removed, worker threads stopped); what it stored stays
    readable until backward no longer needs it.

    >>> lin = nn.Linear(64, 64)
    >>> with compress(lin, min_numel=1) as s:
    ...     loss = lin(torch.randn(128, 64)).square().sum()
    >>> loss.backward()
    >>> [row.kind for row in report(s).rows]  # the input has no autograd history: kept raw
    ['raw', 'compressed']
    """
    session = _session(_config(config, overrides))
    with session:
        handles = session.sites.attach(model) if model is not None else []
        try:
            session.begin_forward(model)
            with session.hooks():
                yield session
        finally:
            for handle in handles:
                handle.remove()
            session.end_forward()


def allocator_status() -> AllocatorStatus:
    """Where this process's CPU tensors come from now (``name``, ``mode``: "in-process" when
    ``daf.wrap`` made an allocator library PyTorch's CPU allocator, "preloaded" under ``daf run`` or
    ``LD_PRELOAD``, "system" otherwise) and why, e.g. which package to install (docs/allocator.md)."""
    return _allocator_status()


def native_status() -> str:
    """Whether DAF's native CPU kernels loaded (building them on first call), and why not if not."""
    from daf.kernels import native_status as status
    return status()
