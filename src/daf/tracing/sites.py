"""Names for the places where tensors are saved, stable from one step to the next.

A site is ``"<module path>#<k>"``: the k-th tensor saved while that module was the
innermost one running, counted from the start of the forward. The same model
with the same control flow gives the same names every step, which is what the
bit policy and the importance index key on.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from daf.tracing.threads import PerThreadStack
from daf.tracing.tensors import storage_addresses

__all__ = ["SiteTracker"]

ROOT = "<root>"


class SiteTracker:
    """Follows which module is running, through forward pre/post hooks on every submodule."""

    def __init__(self) -> None:
        self._local = PerThreadStack()  # a forward on another thread has a module stack of its own
        self._counts: Counter[str] = Counter()
        # Storages of the floating-point tensors without autograd history that submodules returned in
        # this forward (a frozen layer's output before the first trained one): made here, held by
        # nobody but autograd once saved, unlike the caller's input batch.
        self.made: set[int] = set()

    @property
    def _stack(self) -> list[str]:
        return self._local.items

    def reset(self) -> None:
        """Start counting a new forward."""
        self._counts.clear()
        self._stack.clear()
        self.made.clear()

    def made_in_forward(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (or what it views) was returned, without autograd history, by a submodule in
        this forward."""
        return bool(self.made) and not self.made.isdisjoint(storage_addresses(tensor))

    def _note(self, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward
            return
        for value in output if isinstance(output, (tuple, list)) else (output,):
            if (isinstance(value, torch.Tensor) and value.grad_fn is None and value.is_floating_point()
                    and not value.requires_grad and not any(value is a for a in args)):  # an identity returns the input
                self.made.update(storage_addresses(value) - {0})

    def next_site(self) -> str:
        path = self._stack[-1] if self._stack else ROOT
        k = self._counts[path]
        self._counts[path] += 1
        return f"{path}#{k}"

    def attach(self, model: nn.Module) -> list[RemovableHandle]:
        """Hooks on every submodule that keep the path stack; the caller removes them."""
        handles = []
        for path, module in model.named_modules():
            if not path:
                continue
            handles.append(module.register_forward_pre_hook(self.enter(path)))
            handles.append(module.register_forward_hook(self.leave(path), always_call=True))
        return handles

    def enter(self, path: str):
        """A forward pre-hook for the module at ``path``: it runs inside it from now."""
        def hook(module, args):
            self._stack.append(path)
        return hook

    def leave(self, path: str):
        """A forward hook for the module at ``path``: it has returned (or raised)."""
        def hook(module, args, output):
            # An exception inside a child may have left its own entry unpopped; unwind to ours.
            while self._stack and self._stack.pop() != path:
                pass
            self._note(args, output)
        return hook
