"""The per-model state of DAF and the one straight data path: hook -> policy -> codec -> store -> back.

A ``Session`` is owned by a wrapped model (or by a ``daf.compress`` block); nothing
lives at module level. ``pack`` and ``unpack`` are the saved-tensor hooks.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from daf.codec import Codec, make_codec
from daf.codec.mask import (MASK_DTYPES, MaskPacked, decode_mask, encode_mask, encode_relu_mask, mask_bits,
                            two_values)
from daf.config import Config
from daf.format import FLOAT_DTYPES, flatten_memory_order, restore_memory_order
from daf.memory import Store, make_store
from daf.policy import Policy, make_policy
from daf.report import Report, SiteRow
from daf.runtime.background import BackgroundPacker
from daf.runtime.ops import SOFTMAX_RECOMPUTE_BITS, OpCall, OpTracker, backward_exponentiates
from daf.runtime.sites import SiteTracker

__all__ = ["Session"]

_MASK32 = 0xFFFFFFFF


class _Saved:
    """What autograd holds instead of a tensor: a reference into the store.

    The same object is returned for every op that saves the same tensor, so the
    record is released exactly once, when autograd drops the last of them. Under
    background packing ``ref`` is None and ``pending`` holds the future and the
    importance until the session puts the result into the store. A record of the
    nonzeros of a ReLU output holds ``mask``: the ``_Saved`` of ReLU's own 1-bit mask,
    kept alive with it, which says where they go and the output's shape, strides order
    and dtype.
    """

    __slots__ = ("store", "ref", "site", "pending", "mask", "__weakref__")

    def __init__(self, store: Store, ref: int | None, site: str, pending: tuple[Future, float] | None = None,
                 mask: "_Saved | None" = None) -> None:
        self.store, self.ref, self.site, self.pending, self.mask = store, ref, site, pending, mask

    def __del__(self) -> None:
        if self.ref is None:
            return
        try:
            self.store.release(self.ref)
        except Exception:  # interpreter shutdown: nothing left to free
            pass


class Session:
    """Config, codec, policy, store and statistics of one wrapped model."""

    def __init__(self, config: Config, codec: Codec | None = None, policy: Policy | None = None,
                 store: Store | None = None) -> None:
        self.config = config
        self.codec = codec if codec is not None else make_codec(config)
        self.policy = policy if policy is not None else make_policy(config)
        self.store = store if store is not None else make_store(config, self.codec)
        self.sites = SiteTracker()
        self.forwards = 0
        self._packs = 0
        self._rows: list[SiteRow] = []
        self._last_rows: list[SiteRow] = []
        self._shared: dict[tuple, tuple[weakref.ref, int, _Saved]] = {}
        # ReLU masks of this forward by tensor: a later save of the same ReLU output may store codes
        # for its nonzeros only (``Policy.codes_nonzeros_only``), the mask giving the zeros exactly.
        self._relu_masks: dict[tuple, tuple[weakref.ref, int, _Saved]] = {}
        # Which report row counts each tensor's raw bytes: ReLU's output is stored twice (a mask for
        # ReLU, codes for the next op) but autograd without DAF would hold it once; the last row counts it.
        self._counted: dict[tuple, tuple[weakref.ref, int]] = {}
        self._parameter_storages: set[int] = set()
        self._parameters_referenced = 0
        self.packer = BackgroundPacker(self.codec) if config.background else None
        self._pending: list[tuple[_Saved, int]] = []  # background packs and their report row
        # The last tensor unpacked, while its record lives: a tensor saved by two ops (a ReLU
        # output is also the next conv's input) is usually unpacked twice in a row, and this
        # decodes it once. Holds at most one decoded tensor, dropped with its record.
        self._recent: tuple[weakref.ref, torch.Tensor] | None = None
        # Which torch function is running: ReLU masks, the consumers the adaptive policy weighs, and
        # what backward exponentiates (fused attention's saves), kept at 8 bits whatever the policy says.
        self._trackers: list[OpTracker] = []

    # -- lifecycle -------------------------------------------------------------------------
    def begin_forward(self, model: torch.nn.Module | None = None) -> None:
        """Start a new forward: fresh site counters, report rows and sharing table."""
        self.sites.reset()
        self._rows = []
        self._shared.clear()
        self._relu_masks.clear()
        self._counted.clear()
        self._parameters_referenced = 0
        self._parameter_storages = set()
        if model is not None:
            for tensor in [*model.parameters(), *model.buffers()]:
                self._parameter_storages.add(tensor.untyped_storage().data_ptr())
        self.policy.on_forward_start(self.forwards)

    def end_forward(self) -> None:
        self._collect_pending()
        self.forwards += 1
        self._shared.clear()
        self._relu_masks.clear()
        self._last_rows = self._rows

    def hooks(self) -> "_Hooks":
        """The context under which saved tensors go through this session (and ops are tracked)."""
        return _Hooks(self)

    # -- the data path ---------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        site = self.sites.next_site()
        if self._is_parameter(tensor):
            self._parameters_referenced += 1
            return tensor
        call = self._trackers[-1].current if self._trackers else None
        if self.config.masks and call is not None and call.is_relu and self._is_relu_result(tensor):
            # ReLU's own save: its backward reads only whether ``result <= 0`` (NaN passes). Never shared: the next op
            # that saves this tensor needs its values and gets a record of its own.
            saved = self._put_mask(site, tensor, encode_relu_mask(tensor), shareable=False)
            self._relu_masks[self._key(tensor)] = (weakref.ref(tensor), tensor._version, saved)
            return saved
        if not self._compressible(tensor):
            values = self._two_values(tensor)
            if values is not None:
                return self._put_mask(site, tensor, encode_mask(tensor, values), shareable=True)
            self._record(site, tensor, None, tensor.numel() * tensor.element_size(), "raw")
            if call is not None and tensor.dtype.is_floating_point:
                call.saves.append((site, tensor))  # the policy may weigh what backward computes from it
            return tensor
        key = self._key(tensor)
        hit = self._shared.get(key)
        if _holds(hit, tensor):
            self._record(site, tensor, None, 0, "shared")
            if call is not None and isinstance(hit[2], _Saved):
                call.saves.append((hit[2].site, tensor))
            return hit[2]
        values = self._two_values(tensor)
        if values is not None:
            return self._put_mask(site, tensor, encode_mask(tensor, values), shareable=True)
        mask, data = self._nonzeros_of_relu_output(key, tensor)
        bits = self.policy.bits_for(site, data)
        if bits and backward_exponentiates(call, tensor):
            bits = max(bits, SOFTMAX_RECOMPUTE_BITS)
        if bits == 0:
            self._record(site, tensor, None, tensor.numel() * tensor.element_size(), "raw")
            return tensor
        seed = self._next_seed()
        importance = self.policy.importance(site, self._packs)
        if self.packer is not None:
            saved = _Saved(self.store, None, site, (self.packer.submit(data, bits, seed), importance), mask)
            self._pending.append((saved, len(self._rows)))
            stored = 0  # filled in when the packed tensor is collected
        else:
            packed = self.codec.encode(data, bits, seed, consumer=call.name if call is not None else None)
            saved = _Saved(self.store, self.store.put(packed, importance, site), site, None, mask)
            stored = packed.nbytes
        self._shared[key] = (weakref.ref(tensor), tensor._version, saved)
        self.policy.watch(site, data, bits, tensor.numel() if mask is not None else None)
        if call is not None:
            call.saves.append((site, tensor))
        self._record(site, tensor, bits, stored, "compressed")
        return saved

    def _put_mask(self, site: str, tensor: torch.Tensor, packed: Any, shareable: bool) -> "_Saved":
        self._packs += 1
        saved = _Saved(self.store, self.store.put(packed, self.policy.importance(site, self._packs), site), site)
        if shareable:
            self._shared[self._key(tensor)] = (weakref.ref(tensor), tensor._version, saved)
        self._record(site, tensor, 1, packed.nbytes, "mask")
        return saved

    def _nonzeros_of_relu_output(self, key: tuple, tensor: torch.Tensor) -> tuple[_Saved | None, torch.Tensor]:
        """(ReLU's mask record, the nonzeros in memory order) when this tensor is a ReLU output whose
        mask this forward stored and the policy takes codes for nonzeros only; else (None, tensor).
        A NaN (neither > 0 nor 0, so not where the mask says) keeps it whole."""
        entry = self._relu_masks.get(key) if self.policy.codes_nonzeros_only else None
        if not _holds(entry, tensor):
            return None, tensor
        flat, _ = flatten_memory_order(tensor.detach())  # the mask's order: it was made from this tensor
        nonzeros = flat[flat > 0]
        if nonzeros.numel() < max(self.config.min_numel, 1) \
                or nonzeros.numel() + int((flat == 0).sum()) != flat.numel():
            return None, tensor
        return entry[2], nonzeros

    def _two_values(self, tensor: torch.Tensor) -> tuple[float, float] | None:
        """The two values of a tensor that holds no more (stored exactly as a mask), else None."""
        if not self.config.masks or tensor.dtype not in MASK_DTYPES or tensor.layout != torch.strided \
                or tensor.numel() < max(self.config.min_numel, 1) or tensor.is_meta:
            return None
        return two_values(tensor)

    @staticmethod
    def _is_relu_result(tensor: torch.Tensor) -> bool:
        return (tensor.grad_fn is not None and type(tensor.grad_fn).__name__ == "ReluBackward0"
                and tensor.dtype.is_floating_point and tensor.layout == torch.strided and not tensor.is_meta)

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
                tensor.dtype, tensor.device)

    def _op_done(self, call: OpCall) -> None:
        self.policy.watch_op(call)
        call.saves.clear()

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        recent = self._recent
        if recent is not None and recent[0]() is saved:
            return recent[1]
        if saved.ref is None:  # backward (or checkpointing) asked before the forward ended
            self._collect_pending()
        packed = self.store.get(saved.ref)
        tensor = decode_mask(packed) if isinstance(packed, MaskPacked) else self.codec.decode(packed)
        if saved.mask is not None:
            tensor = self._scatter_nonzeros(saved, tensor)
        self._recent = (weakref.ref(saved, self._forget_recent), tensor)
        return tensor

    def _scatter_nonzeros(self, saved: _Saved, nonzeros: torch.Tensor) -> torch.Tensor:
        """The ReLU output whose nonzeros ``saved`` holds: zeros where its mask says so."""
        mask = self.store.get(saved.mask.ref)
        positive = mask_bits(mask)
        count = int(positive.sum())
        if count != nonzeros.numel():
            raise RuntimeError(f"DAF: the record of site {saved.site} holds {nonzeros.numel()} nonzeros but its "
                               f"ReLU mask has {count} set bits; refusing to return wrong data")
        flat = torch.zeros(positive.numel(), dtype=mask.dtype, device=nonzeros.device)
        flat[positive] = nonzeros.to(mask.dtype)
        return restore_memory_order(flat, mask.shape, mask.order)

    def _forget_recent(self, dead: weakref.ref) -> None:
        if self._recent is not None and self._recent[0] is dead:
            self._recent = None

    def _collect_pending(self) -> None:
        """Wait for the background packs of this forward and put them into the store, in pack order."""
        pending, self._pending = self._pending, []
        for saved, row in pending:
            future, importance = saved.pending
            packed = future.result()
            saved.ref, saved.pending = self.store.put(packed, importance, saved.site), None
            if row < len(self._rows) and self._rows[row].site == saved.site:
                self._rows[row] = replace(self._rows[row], stored_bytes=packed.nbytes)

    # -- helpers ---------------------------------------------------------------------------
    def _is_parameter(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
            return True
        return tensor.untyped_storage().data_ptr() in self._parameter_storages

    def _compressible(self, tensor: torch.Tensor) -> bool:
        # Tensors without autograd history (input data, statistics such as attention's logsumexp,
        # values computed under no_grad) stay raw: backward may feed them to exp(), which turns a
        # quantization step into a multiplicative error, and input batches are held by the caller anyway.
        return (tensor.grad_fn is not None and tensor.dtype in FLOAT_DTYPES
                and tensor.numel() >= max(self.config.min_numel, 1)
                and tensor.layout == torch.strided and not tensor.is_meta)

    def _next_seed(self) -> int:
        self._packs += 1
        return _splitmix64(self.config.seed ^ _splitmix64(self._packs)) & _MASK32

    def _record(self, site: str, tensor: torch.Tensor, bits: int | None, stored: int, kind: str) -> None:
        raw = 0 if kind == "shared" else tensor.numel() * tensor.element_size()
        if raw:
            key = self._key(tensor)
            earlier = self._counted.get(key)
            if earlier is not None and earlier[0]() is tensor:  # not a new tensor at a freed address
                self._rows[earlier[1]] = replace(self._rows[earlier[1]], raw_bytes=0)
            self._counted[key] = (weakref.ref(tensor), len(self._rows))
        source = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "no history"
        self._rows.append(SiteRow(site, source, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                                  bits, raw, stored, kind))

    def report(self) -> Report:
        """Figures of the last finished forward."""
        rows = self._last_rows
        sections = {"policy": self.policy.summary(), "store": self.store.stats(),
                    "codec": {"codec": self.codec.name, "group_size": self.config.group_size,
                              "rounding": self.config.rounding}}
        return Report(list(rows), self._parameters_referenced, sections)

    def close(self) -> None:
        """Stop the packer, remove the policy's hooks and close the store to new records; idempotent.

        Records already stored stay readable until autograd releases them: backward may run after.
        """
        if getattr(self, "_closed", False):  # set here, not in __init__, to keep this change to close()
            return
        self._closed = True
        try:
            self._collect_pending()
        finally:  # a failed background pack must not leave the worker thread and the hooks behind
            if self.packer is not None:
                self.packer.close()
            self.policy.close()
            self._recent = None
            self._shared.clear()
            self.store.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Hooks:
    """Saved-tensor hooks of a session, plus its op tracker."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._saved = torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack)
        self._tracker = OpTracker(session._op_done)

    def __enter__(self) -> "_Hooks":
        self._saved.__enter__()
        self._tracker.__enter__()
        self._session._trackers.append(self._tracker)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._session._trackers.remove(self._tracker)
        self._tracker.__exit__(*exc)
        self._saved.__exit__(*exc)


def _holds(entry: tuple[weakref.ref, int, Any] | None, tensor: torch.Tensor) -> bool:
    """Whether a ``(weakref, version, ...)`` table entry is about ``tensor`` as it is now (not another
    tensor at a freed address, not modified in place since)."""
    return entry is not None and entry[0]() is tensor and entry[1] == tensor._version


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)
