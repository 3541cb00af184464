"""The public entry points: ``wrap``, ``unwrap``, ``compress`` and ``report``."""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from daf.allocator.native import AllocatorStatus
from daf.allocator.native import decommit_freed_memory
from daf.allocator.native import install as install_allocator
from daf.allocator.native import status as _allocator_status
from daf.config import Config
from daf.report import Report
from daf.runtime import Session
from daf.runtime.in_graph import GraphSaves, in_graph_hooks, in_graph_limits
from daf.runtime.audit import GradientAudit
from daf.tracing.threads import PerThreadStack

__all__ = ["wrap", "unwrap", "compress", "report", "session_of", "allocator_status", "native_status"]

_ATTR = "_daf_attachment"


def _inert_hook(module: nn.Module, *args: Any) -> None:
    """What a copy of a wrapped model holds in place of DAF's hooks: nothing to do but say so when the copy
    trains (once per process: the warning is issued from this one line). ``daf.wrap`` removes these."""
    if module.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        warnings.warn(COPY_WARNING, stacklevel=1)


def _inert(*args: Any) -> Any:
    return _inert_hook


def _no_attachment() -> None:
    return None


def _run_while_tracing(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``method`` as ``torch.compiler.assume_constant_result`` does: dynamo then runs it once, for real,
    while it traces, and puts its result in the graph as a constant (no graph break, no op). Set by hand
    because that function imports dynamo, seconds at ``import daf``; ``tests/test_compile.py`` checks
    that the mark is the one it sets, and that tracing a wrapped model breaks no graph."""
    method._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return method


class _CompileEntry:
    """What ``torch.compile(model)`` calls for a wrapped model: ``daf.wrap`` puts this entry's bound
    ``__call__`` in the model's ``__dict__`` as ``__call__``. A plain ``model(x)`` never comes here (Python
    calls the class's ``__call__``), but ``torch.compile`` compiles ``model.__call__``.

    Dynamo skips the entry's frame (``_skip_entry_frames``) and compiles the next, ``nn.Module.__call__``,
    so the entry runs eagerly before the compiled frames start: it makes DAF's graph hooks ambient, which
    AOTAutograd inlines into the graphs it compiles and on which dynamo guards (the same pair every step:
    no recompile). It holds the model weakly (no cycle through the model's ``__dict__``); a copy of the
    model (``deepcopy``, pickle) gets an entry of the copy's, which only calls it (copies are unwrapped)."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if torch.compiler.is_compiling():  # dynamo traces this frame: torch._dynamo.reset() dropped the skips
            _entry_traced()
            return type(module).__call__(module, *args, **kwargs)
        attachment = getattr(module, _ATTR, None)
        if attachment is None or not attachment.enter_compiled(module):
            return type(module).__call__(module, *args, **kwargs)
        try:
            return type(module).__call__(module, *args, **kwargs)
        finally:
            attachment.leave_compiled()

    def __deepcopy__(self, memo: dict[int, Any]) -> "_CompileEntry":
        module = self._module()
        return _CompileEntry(memo.get(id(module), module))  # the model's copy, made before its state is

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _CompileEntry, (self._module(),)


def _skip_entry_frames() -> None:
    """Have dynamo run ``_CompileEntry.__call__`` as it is and compile the frames it calls, as
    ``torch.compiler.disable(recursive=False)`` does, and run ``enter_compiled``/``leave_compiled`` and
    all they call eagerly; through the C calls that ``torch._dynamo.eval_frame.skip_code`` makes, so that
    ``daf.wrap`` does not import dynamo (seconds). ``torch._dynamo.reset()`` forgets them: the entry
    then finds itself traced and sets them again (``_entry_traced``)."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    try:
        action, strategy = eval_frame._FrameAction, eval_frame._FrameExecStrategy
        eval_frame.set_code_exec_strategy(_CompileEntry.__call__.__code__, strategy(action.SKIP, action.DEFAULT))
        for method in (_Attachment.enter_compiled, _Attachment.leave_compiled):
            eval_frame.set_code_exec_strategy(method.__code__, strategy(action.SKIP, action.SKIP))
    except AttributeError:  # another torch: the entry is traced and DAF steps aside, as under module.compile()
        pass


@_run_while_tracing
def _entry_traced() -> bool:
    """Run by dynamo, for real, while it traces ``_CompileEntry.__call__``: set the skips again."""
    _skip_entry_frames()
    return True


class _Hook:
    """One of DAF's forward hooks on one module. A copy of the model (``copy.deepcopy``, pickle,
    ``torch.save``) gets ``_inert_hook`` in its place: the hook reaches the session, whose threads,
    locks and store cannot be copied, and the copy comes back unwrapped (``_Attachment.__reduce__``).

    While dynamo traces the module (``torch.compile``, either order, or a compiled part of the tree) the
    hook does nothing but ``traced()``: what it does eagerly (Python state, ``warnings``, reading
    ``grad_fn``) would break the user's graph, and a compiled graph's saves never reach DAF anyway."""

    __slots__ = ("call", "traced")

    def __init__(self, call: Callable[..., None], traced: Callable[[], bool]) -> None:
        self.call = call
        self.traced = traced

    def __call__(self, *args: Any) -> None:
        if torch.compiler.is_compiling():
            self.traced()
            return
        self.call(*args)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert, ()


class _Attachment:
    """The hooks DAF put on one model's tree, and the session they feed.

    A forward begins when a module of the tree runs forward in training on a thread where none of the
    tree is running: the root, or a child that a framework calls directly (``self.model.encoder(x)``).
    Parts that follow one another (an encoder, then a decoder) are one forward, for the report and the
    policy, until a module of a part already run (or one containing it) begins one again. Nothing begins
    under eval, no_grad, inference_mode, while dynamo traces (a compiled part of the tree, or the model
    compiled whole through ``_CompileEntry``, runs under hooks its graphs inline instead,
    ``daf.runtime.in_graph``; traced without them, one warning) or in backward
    (checkpointing's recomputation: what it saves goes to the checkpoint, not to DAF).

    The session is closed by ``unwrap`` or, failing that, when the model is garbage-collected:
    nothing else would stop its threads and remove the policy's hooks. The finalizer holds the
    session, never the model, so it does not keep the model alive.
    """

    def __init__(self, model: nn.Module, session: Session, compiled: list[str]) -> None:
        self.session = session
        self._root = weakref.ref(model)
        self._local = PerThreadStack()  # each thread's forward enters hooks of its own (autograd's are per thread)
        self._parts: set[int] = set()  # ids of the modules that began a part of the current forward
        self._covered: set[int] = set()  # ids of the modules under those
        self._subtrees: dict[int, frozenset[int]] = {}
        # a compiled module runs under hooks AOTAutograd inlines into its graphs (DAF's eager hooks never see its saves)
        self._compiled = {id(model.get_submodule(path)) for path in compiled}
        self.graph_saves = GraphSaves()
        self._in_graph = in_graph_hooks(session.config, self.graph_saves) if compiled else None
        self._warned_compile = bool(compiled)  # wrap warned already
        self._warned_eval = False
        audit = session.config.audit
        self.audit = GradientAudit(session, audit) if audit.every else None
        self.handles = self._attach(model)
        self._finalizer = weakref.finalize(model, session.close)

    def _attach(self, model: nn.Module) -> list[Any]:
        """A pre and a post hook on every module: DAF's begin/end, and the site tracker's path stack."""
        handles = []
        for path, module in model.named_modules():
            enter = self.session.sites.enter(path) if path else None
            leave = self.session.sites.leave(path) if path else None
            handles.append(module.register_forward_pre_hook(_Hook(functools.partial(self._begin, enter), self._traced)))
            handles.append(module.register_forward_hook(_Hook(functools.partial(self._end, leave), self._traced),
                                                        always_call=True))
        if self.audit is not None:  # before the root's _begin: the audit runs before the forward it audits
            handles.append(model.register_forward_pre_hook(_Hook(self._audit, self._traced), prepend=True, with_kwargs=True))
        return handles

    def enter_compiled(self, module: nn.Module) -> bool:
        """Enter the graph hooks for ``torch.compile(daf.wrap(module))``'s training forward (its graphs inline
        them), pushed as this thread's context; False, entering nothing, when the call is not one to compress
        (eval, no_grad, the audit's passes, nested in a forward of the tree). Dynamo runs this and all it calls
        eagerly (``_skip_entry_frames``): entered from the entry's frame, the hooks' ``__enter__`` would be traced."""
        if self._contexts or not self._active(module) or (self.audit is not None and self.audit.running):
            return False
        if self._in_graph is None:
            self._in_graph = in_graph_hooks(self.session.config, self.graph_saves)
        if not self._warned_compile:
            self._warned_compile = True
            warnings.warn(in_graph_warning("this model is compiled with torch.compile", self.session.config),
                          stacklevel=3)
        self._in_graph.__enter__()
        self._contexts.append(self._in_graph)
        return True

    def leave_compiled(self) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def _audit(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The root's forward pre-hook: count a training forward, and audit it when due (runtime/audit.py)."""
        if (not self._contexts and self._active(module) and id(module) not in self._compiled
                and not torch.compiler.is_compiling() and not _compiled_parts(module)):
            # a compiled part would be compiled again for the slice's batch size: DAF causes no recompile
            self.audit.step(module, args, kwargs)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A copy of the model is a plain model (docs/integrations.md, "Copies and EMA"): the session
        # (threads, locks, stored records) cannot be copied, and most copies (EMA, checkpoints) never train.
        return _no_attachment, ()

    @property
    def _contexts(self) -> list[Any]:
        return self._local.items

    @staticmethod
    def _builds_graph() -> bool:
        """Whether a forward now records a graph for a backward of its own (not inside backward)."""
        return (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
                and torch._C._current_graph_task_id() == -1)  # -1: not inside backward

    def _active(self, module: nn.Module) -> bool:
        return module.training and self._builds_graph()

    def _begin(self, enter: Callable[..., None] | None, module: nn.Module, args: Any) -> None:
        contexts = self._contexts
        if self.audit is not None and self.audit.running:
            contexts.append(None)  # the audit's own passes: exact, or through a session of the audit's
        elif id(module) in self._compiled and self._active(module):
            self._in_graph.__enter__()  # held while the module compiles and runs: its graphs inline these hooks
            contexts.append(self._in_graph)
        elif contexts or not self._active(module) or id(module) in self._compiled:
            if not contexts and not module.training and self._builds_graph():  # eval() with grad
                self._warn_eval()
            contexts.append(None)  # nested in a forward of the tree (or inactive): the outermost decides
        else:
            self._begin_part(module)
            context = self.session.hooks()
            context.__enter__()
            contexts.append(context)
        if enter is not None:
            enter(module, args)

    def _begin_part(self, module: nn.Module) -> None:
        subtree = self._subtree(module)
        if not self._parts or self._parts & subtree or id(module) in self._covered:
            # a module that ran in this forward runs again: the next forward (the next step, mostly)
            self._parts, self._covered = {id(module)}, set(subtree)
            self.session.begin_forward(self._root())
        else:  # the next part of the same forward (a decoder after its encoder): end_forward counted it already
            self._parts.add(id(module))
            self._covered |= subtree
            self.session.continue_forward()

    def _subtree(self, module: nn.Module) -> frozenset[int]:
        subtree = self._subtrees.get(id(module))
        if subtree is None:
            subtree = self._subtrees[id(module)] = frozenset(id(m) for m in module.modules())
        return subtree

    def _end(self, leave: Callable[..., None] | None, module: nn.Module, args: Any, output: Any) -> None:
        if leave is not None:
            leave(module, args, output)
        contexts = self._contexts
        if not contexts:
            return
        context = contexts.pop()
        if context is not None:
            context.__exit__(None, None, None)
            if context is not self._in_graph:
                self.session.end_forward()

    def _warn_eval(self) -> None:
        if not self._warned_eval:
            self._warned_eval = True
            warnings.warn(EVAL_WARNING, stacklevel=3)

    @_run_while_tracing
    def _traced(self) -> bool:
        """Run by dynamo while it traces a hook of this tree (never at run time): unless the graph hooks are
        ambient (the graphs being traced compress), warns once per model that nothing is compressed."""
        contexts = self._contexts
        if contexts and contexts[-1] is not None and contexts[-1] is self._in_graph:
            return True
        root = self._root()
        if root is None or not self._active(root):  # eval or no_grad: nothing would be compressed eagerly either
            return True
        if not self._warned_compile:
            self._warned_compile = True
            warnings.warn(COMPILED_WARNING, stacklevel=1)
        return True

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


EVAL_WARNING = ("DAF: the wrapped model ran forward in eval() mode with grad enabled; DAF compresses only in "
                "training mode, so what this forward saves for backward is kept as it is. Call model.train() "
                "to train with DAF, or evaluate under torch.no_grad(). (Said once per wrapped model.)")
COPY_WARNING = ("DAF: a copy of a wrapped model (deepcopy, pickle, torch.save, AveragedModel) is trained, and "
                "copies come back unwrapped: nothing it saves is compressed. Call daf.wrap(copy) to compress "
                "it (docs/integrations.md, 'Copies and EMA').")
COMPILED_WARNING = (
    "DAF: dynamo traces this wrapped model without DAF's graph hooks, and DAF compresses nothing there: the "
    "graph saves its tensors as they are (full activation memory). This happens when the compiled model is a "
    "torch.nn container (nn.Sequential, a torch.nn layer), when a compiled function calls the model, and "
    "under module.compile(). To compress inside the graph, compile a model whose forward is your own, "
    "torch.compile(daf.wrap(model)), or wrap the compiled model, daf.wrap(torch.compile(model)) "
    "(docs/integrations.md, 'torch.compile').")
IN_GRAPH_WARNING = (
    "DAF: {what}: inside its graphs DAF stores the policy's codes of the intermediates they save, decided "
    "from each graph at compile time, without the eager path's derived forms{limits}. daf.report(model) "
    "lists each graph save, its width, and why what stays raw does (docs/integrations.md, 'torch.compile').")


def in_graph_warning(what: str, config: Config) -> str:
    limits = in_graph_limits(config)
    return IN_GRAPH_WARNING.format(what=what, limits="; with " + ", ".join(limits) if limits else "")


def _remove_inert_hooks(model: nn.Module) -> None:
    """Drop what a copy kept of an earlier wrapping (``_inert_hook``): the model is being wrapped anew."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [key for key, hook in hooks.items() if hook is _inert_hook]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
                module._forward_pre_hooks_with_kwargs.pop(key, None)


def _compiled_parts(model: nn.Module) -> list[str]:
    """Paths of the compiled modules in ``model``'s tree ("" for the model itself)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # dynamo never imported: nothing was compiled (and importing it costs seconds)
        return []
    return [path for path, module in model.named_modules() if isinstance(module, eval_frame.OptimizedModule)]


def _config(config: Config | None, overrides: dict[str, Any]) -> Config:
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"config must be a daf.Config or None, got {type(config).__name__}")
    base = config if config is not None else Config()
    return base.replace(**overrides) if overrides else base


def _session(config: Config) -> Session:
    # The allocator first: the savings reach the process only if freed temporaries' memory is reused.
    install_allocator(config.allocator)
    if config.decommit:
        decommit_freed_memory()
    return Session(config)


def wrap(model: nn.Module, config: Config | None = None, **overrides: Any) -> nn.Module:
    """Compress what ``model`` saves for backward while it trains; returns the same module.

    Active while ``model``, or any module of its tree called on its own, runs forward in training mode
    with grad enabled; under ``eval()``, ``torch.no_grad()`` or ``torch.inference_mode()`` nothing changes.
    Under ``torch.compile``, in either order (``torch.compile(wrap(model))``, ``wrap(torch.compile(model))``,
    compiled parts): the graphs save the policy's codes (``daf.runtime.in_graph``), listed in the report;
    the graphs are those of the unwrapped model, and DAF warns once with what a graph cannot do. A copy of the
    model (``copy.deepcopy``, pickle, ``torch.save``) is unwrapped: wrap it again to train it compressed.
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
    config = _config(config, overrides)
    compiled = _compiled_parts(model)
    if compiled:
        what = ("this model is compiled with torch.compile" if "" in compiled
                else f"{', '.join(compiled)} of this model run under torch.compile")
        warnings.warn(in_graph_warning(what, config), stacklevel=2)
    _remove_inert_hooks(model)
    object.__setattr__(model, _ATTR, _Attachment(model, _session(config), compiled))
    _skip_entry_frames()
    model.__dict__["__call__"] = _CompileEntry(model).__call__  # what torch.compile(model) calls
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Remove DAF from ``model``: its hooks and its policy's gone, its worker threads stopped; what a forward
    before stored stays readable for backward, each record freed once backward no longer needs it."""
    attachment = getattr(model, _ATTR, None)
    if attachment is None:
        raise ValueError("this model is not wrapped by DAF (use daf.wrap(model) first)")
    object.__delattr__(model, _ATTR)
    model.__dict__.pop("__call__", None)
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
    eager = session.report()
    graph_rows = [] if isinstance(model, Session) else getattr(model, _ATTR).graph_saves.rows()
    if not graph_rows:
        return eager
    graphs = len({row.site.split("/")[0] for row in graph_rows})
    section = {"graphs": graphs, "saves": len(graph_rows), "raw": sum(row.kind == "raw" for row in graph_rows),
               "rounding": "nearest", "groups": "min/max"}
    return Report(rows=eager.rows + graph_rows, parameters_referenced=eager.parameters_referenced,
                  sections={**eager.sections, "compiled graphs": section}, forward=eager.forward)


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
