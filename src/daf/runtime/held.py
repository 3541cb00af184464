"""Norm inputs held until the op after the norm is known, then split by its ReLU mask.

A batch or group norm's input is saved before the ReLU that may follow the norm has run. The session
holds it (as ``HELD_BITS`` codes, at most ``MOST_HELD`` at a time, each for one or two ops); when a ReLU
saves its mask and its input is the norm's output (``relu(norm(x))``) or a sum of norm outputs
(``relu(norm(x) + shortcut)``), each held input behind it is coded split by that mask
(``daf.codec.split``: codes at twice the width where the mask passes the gradient, group means elsewhere)
and keeps a reference to the mask's record, which it decodes with. An input no ReLU claims is coded as
plain codes when another op saves a tensor (any but a convolution's or a norm's, which a shortcut makes
between a norm and its ReLU), when a third is held, when the forward ends or when backward asks for it
first.

The split assumes what a CNN block does: the norm's output is read by the ReLU path only, so its gradient
is zero where the mask is. A norm output that something else also reads gets its input's masked-out
elements back as group means; the gradient audit (``daf.runtime.audit``) measures what that costs.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from daf.codec import Codecs, Spec
from daf.format import Packed, dense_order
from daf.memory import Store
from daf.runtime.accounting import Accounting
from daf.runtime.records import Saved

__all__ = ["Held", "HeldInputs", "HELD_BITS", "MOST_HELD", "NORM_NODES", "SPLIT_READERS", "keeps_held", "norms_under_relu",
           "splittable"]

MOST_HELD = 2  # a ResNet block with a downsampling shortcut holds two (bn2's and the shortcut norm's input)
# The held form: the raw input held until its ReLU cost one or two of a ResNet's largest activations at the
# forward's peak (docs/results.md); 8-bit codes cost a quarter, and add under 1/15 of a 4-bit step's error.
HELD_BITS = 8
NORM_NODES = frozenset({"NativeBatchNormBackward0", "NativeGroupNormBackward0"})
SPLIT_READERS = frozenset({"batch_norm", "group_norm"})  # ops that may read a split record (its others: means)
# Saves between a norm and its ReLU that leave the held inputs held: the norm's own, a shortcut's conv and norm
_BETWEEN = frozenset({*SPLIT_READERS, "conv1d", "conv2d", "conv3d"})


@dataclasses.dataclass(eq=False)
class Held:
    """A norm input waiting for its ReLU: the record handed to autograd, the input as 8-bit codes (a quarter
    of its bytes, so that holding it costs little: ``HELD_BITS``), how it is coded plainly (``codec``,
    ``spec``) and its importance."""

    saved: Saved
    packed: Any
    codec: str
    spec: Spec
    importance: float
    row: int = -1


class HeldInputs:
    """The held norm inputs of the forwards in progress, oldest first, and how each is coded when it goes:
    split by a ReLU's mask, or plainly. Thread-safe: two threads may run forward on one wrapped model at
    once, and each entry is taken by exactly one of them."""

    def __init__(self, codecs: Codecs, store: Store, accounting: Accounting) -> None:
        self._codecs, self._store, self._accounting = codecs, store, accounting
        self._held: list[Held] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, saved: Saved, tensor: torch.Tensor, codec: str, spec: Spec, importance: float) -> None:
        """Hold ``tensor`` (as ``HELD_BITS`` codes) for record ``saved``; the oldest held is coded plainly when
        that makes more than ``MOST_HELD``."""
        held = Held(saved, self._codecs.encode_held(tensor, HELD_BITS), codec, spec, importance)
        with self._lock:
            self._held.append(held)
            oldest = self._held.pop(0) if len(self._held) > MOST_HELD else None
        if oldest is not None:
            self._store_plainly(oldest)

    def split_by(self, relu_output: torch.Tensor, mask_record: Saved, records: list[Any]) -> None:
        """Code the held ones among ``records`` (what the norms behind this ReLU saved as their input) split by
        its mask, whose record ``mask_record`` was just stored."""
        mask = None
        for record in records:
            held = self._take(record)
            if held is None:
                continue
            spec = dataclasses.replace(held.spec, bits=min(8, 2 * held.spec.bits))
            if splittable(held.packed, relu_output):
                mask = self._store.get(mask_record.ref) if mask is None else mask  # ReLU's bits
                packed = self._codecs.encode_split_held(held.packed, mask, spec)  # never decoded whole
            else:
                packed = None
            if packed is None:
                self._store_plainly(held)
                continue
            held.saved.mask, held.saved.bits = mask_record, spec.bits
            why = (f"split by the ReLU mask of {mask_record.site}: {spec.bits}-bit codes where it passes, "
                   f"group means elsewhere")
            self._put(held, packed, why)  # its row keeps the policy's width: it costs about that

    def store_all(self) -> None:
        """Code every held input plainly (no ReLU claimed it)."""
        with self._lock:
            held, self._held = self._held, []
        for entry in held:
            self._store_plainly(entry)

    def _take(self, saved: Any) -> Held | None:
        with self._lock:
            for i, held in enumerate(self._held):
                if held.saved is saved:
                    return self._held.pop(i)
        return None

    def _store_plainly(self, held: Held) -> None:
        """As it would have been coded at its save."""
        held.saved.readers = None
        self._put(held, self._codecs.encode(held.codec, self._codecs.decode(held.packed), held.spec), None)

    def _put(self, held: Held, packed: Any, why: str | None) -> None:
        saved = held.saved
        saved.ref = self._store.put(packed, held.importance, saved.site)
        self._accounting.fill(saved.row, saved.site, packed.nbytes, why=why)


def keeps_held(op: Any) -> bool:
    """Whether a save by ``op`` (an ``OpCall`` or None) may come between a norm and the ReLU after it."""
    return op is None or op.is_relu or op.name in _BETWEEN


def norms_under_relu(relu_output: torch.Tensor) -> list[Any]:
    """The batch or group norm nodes whose output a ReLU output is ``relu`` of, alone or summed:
    ``relu(norm(x))`` -> [norm]; ``relu(norm(x) + norm2(y))`` -> [norm, norm2]; ``relu(norm(x) + y)`` -> [norm]."""
    node = relu_output.grad_fn
    if node is None or type(node).__name__ != "ReluBackward0":
        return []
    below, output_nr = node.next_functions[0]
    if below is not None and type(below).__name__ == "AddBackward0" and output_nr == 0:
        operands = list(below.next_functions)
    else:
        operands = [(below, output_nr)]
    return [n for n, nr in operands if n is not None and nr == 0 and type(n).__name__ in NORM_NODES]


def splittable(x: torch.Tensor | Packed, relu_output: torch.Tensor) -> bool:
    """Whether ``x`` (a tensor, or codes of one) lines up element for element with the ReLU output's mask: same
    shape and device, both dense in the same memory order."""
    if isinstance(x, Packed):
        shape, device, dtype, order = tuple(x.shape), x.payload.device, x.dtype, tuple(x.order)
    else:
        shape, device, dtype, order = tuple(x.shape), x.device, x.dtype, dense_order(x)
    if shape != tuple(relu_output.shape) or device != relu_output.device or not dtype.is_floating_point:
        return False
    expected = dense_order(relu_output)
    return expected is not None and order is not None and tuple(order) == tuple(expected)
