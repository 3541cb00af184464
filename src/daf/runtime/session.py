"""The per-model state of DAF and the one straight data path: hook -> route -> codec -> store -> back.

A ``Session`` is owned by a wrapped model (or by a ``daf.compress`` block); nothing
lives at module level. ``pack`` and ``unpack`` are the saved-tensor hooks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from daf.allocator import status as allocator_status
from daf.codec import Codecs, Spec
from daf.config import Config, MinMax, Outliers
from daf.memory import Store, make_store
from daf.policy import Policy, make_policy
from daf.policy.exponent_guard import HEAD_INPUT_BITS, guarded_choice
from daf.report import Report
from daf.runtime.accounting import Accounting
from daf.runtime.background import BackgroundPacker
from daf.runtime.derived import Derived, DerivedActivation, DerivedAttention, DerivedProduct, DerivedStatistic
from daf.runtime.held import SPLIT_READERS, HeldInputs, keeps_held, norms_under_relu
from daf.runtime.layout import reads_any_layout, restores_channels_last, restores_raw_channels_last
from daf.runtime.recent import RecentDecodes
from daf.runtime.remade import RemadeValues
from daf.runtime.records import NO_CHECK, HeadInput, Kept, Saved, Source, check_version
from daf.runtime.remakes import ABSENT, LinearCalls, NormCalls, Remakes
from daf.runtime.route import Context, Encoding, Kind, route
from daf.runtime.snapshots import MaskCopies
from daf.tracing import (ATTENTION_FUNCTIONS, OpCall, OpTracker, SiteTracker, TensorTable, is_parameter, made_in_call,
                         masked_product_of, nodes_made_by, parameter_storages, tensors_in)
from daf.tracing.threads import PerThreadStack

__all__ = ["Session"]

_MASK32 = 0xFFFFFFFF
EXACT = (Kind.MASK, Kind.RELU_MASK, Kind.REGION_MASK)  # records that decode to what the op reads, bit for bit


class Session:
    """Config, codecs, policy, store and accounting of one wrapped model."""

    def __init__(self, config: Config, codecs: Codecs | None = None, policy: Policy | None = None,
                 store: Store | None = None, remakes: Remakes | None = None) -> None:
        self.config = config
        self.min_numel = config.min_numel
        # The rules that remake saves; they read this forward's records through this session (remakes.Records)
        self.remakes = remakes if remakes is not None else Remakes.named(config.remakes)
        self.codecs = codecs if codecs is not None else Codecs(config)
        self.policy = policy if policy is not None else make_policy(config)
        self.store = store if store is not None else make_store(config, self.codecs.reencode)
        self.sites = SiteTracker()
        self.accounting = Accounting()
        self.forwards = 0
        self._packs = 0
        self._shared = TensorTable()  # stored tensors of this forward: a second save shares the record
        self._relu_masks = TensorTable()  # ReLU masks of this forward, for the codes of nonzeros only
        # norm inputs waiting for the ReLU that may split them (daf.runtime.held)
        self._held = HeldInputs(self.codecs, self.store, self.accounting)
        # Records of this forward by the autograd node (and output number) that made their tensor: the x of
        # a dropout product x * mask is found from the multiply's input edge. The node is kept with it, so
        # that its id cannot be reused while the entry lives.
        self._outputs: dict[tuple[int, int], tuple[Any, Saved]] = {}
        # Remade saves of this forward by the same key: attention's probabilities, which dropout multiplies
        self._remade: dict[tuple[int, int], tuple[Any, DerivedActivation]] = {}
        # The same by the value they remake (daf.runtime.remade): a second view of it shares the record
        self._values = RemadeValues()
        # Linear and norm calls of this forward by their output's node, which remake rules read (a head's input
        # and weight; a norm's affine parameters, which autograd does not save)
        self.linears, self.norms = LinearCalls(), NormCalls()
        # Fused attention's logsumexp kept in a call still running, by the call: remade with the call's output
        # if that is remade (autograd saves the logsumexp first). (call, record, its report row)
        self._statistics: dict[int, tuple[OpCall, DerivedStatistic, int]] = {}
        # Nodes made by calls whose saves went through this session's pack hook (id -> node, kept alive
        # with it): the only nodes whose saves it reads (``readable``).
        self._made_here: dict[int, Any] = {}
        self._mask_copies = MaskCopies()  # what remade attention probabilities read in backward, not the live mask
        # (thread, records) while record_behind reads a graph node's _saved_*: another thread's unpacks go on
        self._captured: tuple[int, list[Any]] | None = None
        self._parameter_storages: set[int] = set()
        self.packer = BackgroundPacker(self.codecs.serial_twin()) if config.background else None
        self._pending: list[Saved] = []
        # The tensors unpacked last, while their records live: a tensor saved by two ops (a ReLU
        # output is also the next conv's input) is usually unpacked twice close together, and this
        # decodes it once (daf.runtime.recent: one decoded tensor and a small one beside it).
        self._recent = RecentDecodes()
        # The same for the last remade save, apart: attention's probabilities are unpacked for p @ v
        # (through the dropped map) and again for the softmax, with v and the mask decoded between;
        # an LM's log-probabilities for nll_loss and log_softmax. Remade once each.
        self._recent_remade: tuple[weakref.ref, torch.Tensor, int] | None = None  # and its version then
        # Which torch function is running, per thread (torch's function modes are per thread too).
        self._local = PerThreadStack()
        self._why = threading.local()  # the reason behind the width _bits_for gave last on this thread
        self._closed = False
        # Widths the gradient audit raised, by site (``raise_bits``; 0: keep raw); read by ``_bits_for``
        self.raised: dict[str, int] = {}
        # Report sections others keep (the audit's): name -> what ``report`` shows under it
        self.sections: dict[str, Callable[[], dict[str, Any]]] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def begin_forward(self, model: torch.nn.Module | None = None) -> None:
        """Start a new forward: fresh site counters, report rows and sharing tables."""
        self.sites.reset()
        self.accounting.begin()
        self._shared.clear()
        self._relu_masks.clear()
        self._outputs.clear()
        self._remade.clear()
        self._values.clear()
        self.linears.clear()
        self.norms.clear()
        self._statistics.clear()
        self._made_here.clear()
        self._mask_copies.clear()
        self._parameter_storages = parameter_storages(model)
        self.policy.on_forward_start(self.forwards)

    def end_forward(self) -> None:
        self._collect_pending()
        self.forwards += 1
        self.sites.made.clear()  # addresses: after forward they may be any tensor's
        self._shared.clear()
        self._relu_masks.clear()
        self._outputs.clear()
        self._remade.clear()
        self._values.clear()
        self.linears.clear()
        self.norms.clear()
        self._statistics.clear()
        self._made_here.clear()
        self._mask_copies.clear()
        self.accounting.end()

    def continue_forward(self) -> None:
        """The forward that ended last goes on (a decoder after its encoder, called one by one by a
        framework): the same step for the policy, its rows in the same report."""
        self.forwards -= 1

    def hooks(self) -> "_Hooks":
        """The context under which saved tensors go through this session (and ops are tracked)."""
        return _Hooks(self)

    # -- the data path ---------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        site = self.sites.next_site()
        op = self._current_op()
        if len(self._held) and not keeps_held(op):  # no ReLU follows those norms: code them before routing reads them
            self._held.store_all()
        context = self._context(site, tensor, op)
        self._why.reason = ""
        encoding = route(tensor, context)
        saved, stored = self._keep(encoding, tensor, context)
        why = self._why.reason if encoding.kind in (Kind.CODES, Kind.NONZEROS, Kind.RAW) else ""
        if context.remake is not None:  # remade, or why not
            why = context.remake.why if encoding.data is context.remake else _not_remade(why, context.remake, encoding)
        row = self.accounting.add(site, tensor, encoding, stored, why)
        if isinstance(saved, Saved) and (saved.pending is not None or saved.ref is None):
            saved.row = row  # its bytes are filled in when the background pack is collected (or the held input coded)
        elif isinstance(saved, DerivedStatistic):
            self._statistics[id(op)] = (op, saved, row)
        self._observe(op, encoding, site, tensor, saved)
        return saved

    def _keep(self, encoding: Encoding, tensor: torch.Tensor, context: Context) -> tuple[Any, int]:
        """What autograd holds for ``tensor``, and the bytes that costs."""
        if encoding.kind.stored:
            return self._encode_and_put(encoding, tensor, context)
        if encoding.kind is Kind.SHARED:
            if self.config.channels_last and isinstance(context.shared, Saved) and not reads_any_layout(context.op):
                context.shared.channels_last = False  # this op's backward gets the layout it saved
            return context.shared, 0
        if encoding.kind is Kind.DERIVED and isinstance(encoding.data, torch.Tensor):
            return Derived(tensor, encoding.data, context.site, Source(tensor)), 0
        if encoding.kind is Kind.DERIVED and encoding.data is context.remake:
            remake = encoding.data
            same = self._values.get(remake, tensor)
            if same is not None:  # another view of a value this forward remakes already: remade once for both
                return same, 0
            self.policy.watch(context.site, tensor, remake.bits, derived=True)
            records = tuple(self._encode_head_input(r, context.site) if isinstance(r, HeadInput) else r
                            for r in remake.records)
            kind = DerivedAttention if remake.with_statistic else DerivedActivation
            derived = kind(tensor, records, remake.function, context.site, Source(tensor), self.unpack)
            derived.bits = remake.bits
            if remake.with_statistic:
                self._remake_statistic(context.op, derived)
            if tensor.grad_fn is not None:
                self._remade[(id(tensor.grad_fn), tensor.output_nr)] = (tensor.grad_fn, derived)
            self._values.put(remake, tensor, derived)
            if not remake.with_statistic:  # saved again (log-probabilities by nll_loss, a block's output by the
                self._shared.put(tensor, derived)  # shortcut's conv): shared, not remade twice
            return derived, 0
        if encoding.kind is Kind.DERIVED:
            x, mask = encoding.data
            return DerivedProduct(tensor, x, mask, context.site, Source(tensor), self.unpack), 0
        raw = encoding.kind is Kind.RAW
        channels_last = raw and restores_raw_channels_last(tensor, context.op, self.config.channels_last)
        kept = Kept(tensor, context.site, channels_last)
        if raw and context.op is not None and context.op.is_attention_statistic(tensor):
            kept = DerivedStatistic(kept)
        return kept, tensor.numel() * tensor.element_size() if raw else 0

    def _remake_statistic(self, op: OpCall | None, derived: DerivedAttention) -> None:
        """The logsumexp this attention call kept is remade with its output from now on (and let go)."""
        entry = self._statistics.pop(id(op), None)
        if entry is not None and entry[0] is op:
            entry[1].derive_from(derived)
            self.accounting.fill(entry[2], entry[1].site, 0, kind="derived")

    def _context(self, site: str, tensor: torch.Tensor, op: OpCall | None) -> Context:
        parameter = is_parameter(tensor, self._parameter_storages)
        common = dict(site=site, op=op, is_parameter=parameter, masks=self.config.masks,
                      min_numel=self.config.min_numel, nonzeros_only=self.policy.codes_nonzeros_only,
                      bits_for=self._bits_for)
        if parameter or tensor.numel() < max(self.config.min_numel, 1):
            # Routed by rules 1-3 alone (a parameter; or too small to compress: kept, or a cast of a
            # parameter): no earlier record, product or remake is read, so none is looked up (two
            # thirds of a ResNet's saves are weights and batch norm statistics).
            return Context(**common, shared=None, relu_mask=None)
        arguments = op.weight_arguments if tensor.grad_fn is None and op is not None else []
        input_made_here = bool(arguments) and (self.sites.made_in_forward(tensor) or made_in_call(tensor, arguments))
        if input_made_here and op.func in ATTENTION_FUNCTIONS:  # q, k, v reshaped; not logsumexp, read through exp
            input_made_here = any(a.numel() == tensor.numel() for a in arguments)
        if op is not None:  # a tensor this very call made (an op saving its own output): its node saves through us now
            self._mark_made_here(nodes_made_by([tensor], op.argument_nodes, most=4))
        return Context(**common, input_made_here=input_made_here, product_of=self._product_of(tensor),
                       remake=self.remakes.find(tensor, op, self), shared=self._shareable(tensor, op),
                       relu_mask=self._relu_masks.get(tensor))

    def _shareable(self, tensor: torch.Tensor, op: OpCall | None) -> "Saved | None":
        """The record of an earlier save of ``tensor`` in this forward, if ``op`` may read it."""
        saved = self._shared.get(tensor)
        if saved is not None and saved.readers is not None and (op is None or op.name not in saved.readers):
            return None
        return saved

    def _product_of(self, tensor: torch.Tensor) -> tuple["Saved", "Saved"] | None:
        """The records (x, mask) when ``tensor`` is x times an exact mask and both are stored in this forward."""
        product = masked_product_of(tensor) if self.config.masks else None
        if product is None:
            return None
        x = self.record_of(product.node, product.output_nr) or self.remade_output(product.node, product.output_nr)
        if x is None:  # no need to look for the mask
            return None
        mask = self.record_behind(product.multiply, product.mask_attribute)
        if not isinstance(mask, Saved) or not mask.exact:
            return None
        if mask.numel != tensor.numel():  # a broadcast mask: the product has elements of its own
            return None
        return x, mask

    # -- what remake rules read (daf.runtime.remakes.Records) ---------------------------------
    def record_of(self, node: Any, output_nr: int, reader: str | None = None) -> "Saved | None":
        """The record stored in this forward of output ``output_nr`` of autograd node ``node``, if it
        decodes to that tensor for every op (not derivative codes or log-probabilities), or for op
        ``reader`` (a norm, for its input split by a ReLU mask)."""
        entry = self._outputs.get((id(node), output_nr))
        if entry is None or entry[0] is not node:
            return None
        readers = entry[1].readers
        return entry[1] if readers is None or (reader is not None and reader in readers) else None

    def _encode_head_input(self, head_input: "HeadInput", site: str) -> "Saved":
        """Code the head's input at ``HEAD_INPUT_BITS`` as a record of its own; its row counts the bytes
        and no raw bytes (for a frozen head autograd would not keep it; a trained head's linear saves it
        apart, and that row counts them)."""
        y, spec = head_input.tensor, Spec(HEAD_INPUT_BITS, self._next_seed(), "linear")
        packed = self.codecs.encode("codes", y, spec)
        input_site = f"{site}.head_input"
        saved = Saved(self.store, self.store.put(packed, self.policy.importance(site, self._packs), input_site),
                      input_site, NO_CHECK)
        saved.numel, saved.bits = y.numel(), HEAD_INPUT_BITS
        self.accounting.add_unsaved(input_site, y, HEAD_INPUT_BITS, packed.nbytes)
        return saved

    def remade_output(self, node: Any, output_nr: int) -> DerivedActivation | None:
        """The remade save of this forward of output ``output_nr`` of ``node`` (attention's probabilities)."""
        entry = self._remade.get((id(node), output_nr))
        return entry[1] if entry is not None and entry[0] is node else None

    def record_behind(self, node: Any, attribute: str) -> Any:
        """What this session's pack hook returned for the tensor that ``node`` saved as ``attribute``:
        reading a ``_saved_*`` attribute calls the unpack hook, which here only names the record.
        ``ABSENT`` where the node saved None there (no attention mask), None where nothing is known."""
        if not self.readable(node):
            return None
        captured: list[Any] = []
        self._captured = (threading.get_ident(), captured)
        try:
            value = getattr(node, attribute)
        except Exception:  # released, or not a saved tensor: no product to derive
            return None
        finally:
            self._captured = None
        if value is None:
            return ABSENT
        return captured[0] if len(captured) == 1 else None

    def _encode_and_put(self, encoding: Encoding, tensor: torch.Tensor, context: Context) -> tuple["Saved", int]:
        """Encode (here or on the packer's thread) and store; (the record, its bytes: 0 while pending)."""
        site, op = context.site, context.op
        spec = Spec(encoding.bits, self._next_seed(), op.name if op is not None else None, encoding.values)
        importance = self.policy.importance(site, self._packs)
        data = encoding.data if encoding.data is not None else tensor
        mask = context.relu_mask if encoding.kind is Kind.NONZEROS else None
        codes = encoding.kind in (Kind.CODES, Kind.NONZEROS)
        if self._holds(encoding, tensor, op):
            return self._hold(encoding, tensor, context, spec, importance), 0
        if codes and self.packer is not None:
            saved = Saved(self.store, None, site, Source(tensor),
                          (self.packer.submit(encoding.codec, data, spec), importance), mask)
            self._pending.append(saved)
            stored = 0
        else:
            packed = self.codecs.encode(encoding.codec, data, spec)
            saved = Saved(self.store, self.store.put(packed, importance, site), site, Source(tensor), None, mask)
            stored = packed.nbytes
        saved.exact, saved.numel, saved.bits = encoding.kind in EXACT, tensor.numel(), encoding.bits
        saved.channels_last = restores_channels_last(tensor, op, self.config.channels_last)
        if tensor.grad_fn is not None and encoding.kind not in (Kind.RELU_MASK, Kind.REGION_MASK):
            self._outputs[(id(tensor.grad_fn), tensor.output_nr)] = (tensor.grad_fn, saved)  # decodes to the tensor
        if encoding.kind is Kind.RELU_MASK:
            self._relu_masks.put(tensor, saved)  # never shared: the next op needs the values
            if len(self._held):
                self._held.split_by(tensor, saved, [self.record_behind(n, "_saved_input") for n in norms_under_relu(tensor)])
        elif encoding.kind is not Kind.REGION_MASK:  # a region record is its op's alone, as a ReLU mask
            # derivative codes are GELU's only; log-probabilities are -inf where a probability codes to 0
            saved.readers = self.codecs.readers(encoding.codec, data, spec)
            self._shared.put(tensor, saved)
        if codes:
            self.policy.watch(site, data, encoding.bits, tensor.numel() if mask is not None else None)
        return saved, stored

    # -- norm inputs held for the ReLU after them (daf.runtime.held) ---------------------------
    def _holds(self, encoding: Encoding, tensor: torch.Tensor, op: OpCall | None) -> bool:
        """Whether to hold ``tensor`` for a split (``Config.split_norm_inputs``): a norm's input coded at 1 or
        2 bits, where the block's output may be remade from it (rule ``norm_block``), under MinMax or
        Outliers codes (the default; DIVISION or a registered codec asked for keeps its own). Not at 4 bits
        or more: the masked-out elements as group means cost more gradient error than such codes."""
        return (self.config.split_norm_inputs and encoding.kind is Kind.CODES and encoding.codec == "codes"
                and encoding.data is None and isinstance(self.config.codec, (MinMax, Outliers))
                and encoding.bits in (1, 2) and op is not None and op.name in SPLIT_READERS
                and tensor.grad_fn is not None and "norm_block" in self.remakes.names)

    def _hold(self, encoding: Encoding, tensor: torch.Tensor, context: Context, spec: Spec, importance: float) -> Saved:
        saved = Saved(self.store, None, context.site, Source(tensor))
        saved.numel, saved.bits, saved.readers = tensor.numel(), encoding.bits, SPLIT_READERS
        saved.channels_last = restores_channels_last(tensor, context.op, self.config.channels_last)
        self._outputs[(id(tensor.grad_fn), tensor.output_nr)] = (tensor.grad_fn, saved)  # the block walk's leaf
        self.policy.watch(context.site, tensor, encoding.bits, None)
        self._held.hold(saved, tensor, encoding.codec, spec, importance)
        return saved

    def _observe(self, op: OpCall | None, encoding: Encoding, site: str, tensor: torch.Tensor, saved: Any) -> None:
        """Tell the op's call which stored (or raw floating-point) tensors it saved: the policy
        weighs what backward computes from them (``Policy.watch_op``)."""
        if op is None:
            return
        if encoding.kind in (Kind.CODES, Kind.NONZEROS):
            op.saves.append((site, tensor))
        elif encoding.kind is Kind.SHARED and isinstance(saved, Saved):
            op.saves.append((saved.site, tensor))
        elif isinstance(saved, DerivedActivation):  # what the plan weighs when it gives this site more bits
            op.saves.append((saved.site, tensor))  # the first save's site where a second view shares it
        elif encoding == Encoding(Kind.RAW) and tensor.dtype.is_floating_point:
            op.saves.append((site, tensor))

    def unpack(self, saved: Any) -> torch.Tensor:
        captured = self._captured
        if captured is not None and captured[0] == threading.get_ident():  # record_behind: which record, no decode
            captured[1].append(saved)
            return torch.empty(0)
        if isinstance(saved, DerivedActivation):
            return self._remade_tensor(saved)
        if isinstance(saved, DerivedStatistic):
            return saved.unpack(self._remade_tensor)
        if isinstance(saved, (Kept, Derived, DerivedProduct)):
            return saved.unpack()
        saved.source.check(saved.site)
        saved.handed.check(saved.site)  # a backward that changed what the last reader got (plain raises too)
        recent = self._recent.get(saved)
        if recent is not None:
            return saved.handed.hand(recent)
        if saved.ref is None:  # backward (or checkpointing) asked before the forward ended
            self._collect_pending()
        packed = self.store.get(saved.ref)
        if saved.mask is None:
            tensor = self.codecs.decode(packed, saved.channels_last)
        else:
            tensor = self.codecs.decode_with_mask(packed, self.store.get(saved.mask.ref), saved.site, saved.channels_last)
        self._recent.put(saved, tensor)
        return saved.handed.hand(tensor)

    def _remade_tensor(self, saved: DerivedActivation) -> torch.Tensor:
        recent = self._recent_remade
        if recent is not None and recent[0]() is saved:
            saved.source.check(saved.site)
            check_version(recent[1], recent[2], saved.site)  # changed in place by the backward that read it
            return recent[1]
        tensor = saved.unpack()
        self._recent_remade = (weakref.ref(saved, self._forget_recent), tensor, tensor._version)
        return tensor

    def _forget_recent(self, dead: weakref.ref) -> None:
        if self._recent_remade is not None and self._recent_remade[0] is dead:
            self._recent_remade = None

    def _collect_pending(self) -> None:
        """Code the held norm inputs; wait for the background packs of this forward and put them into the
        store, in pack order."""
        self._held.store_all()
        pending, self._pending = self._pending, []
        for saved in pending:
            future, importance = saved.pending
            packed = future.result()
            saved.ref, saved.pending = self.store.put(packed, importance, saved.site), None
            self.accounting.fill(saved.row, saved.site, packed.nbytes)

    # -- op tracking -----------------------------------------------------------------------
    def _trackers(self) -> list[OpTracker]:
        return self._local.items

    def _current_op(self) -> OpCall | None:
        trackers = self._trackers()
        return trackers[-1].current if trackers else None

    def _bits_for(self, site: str, x: torch.Tensor, op: OpCall | None) -> int:
        bits, self._why.reason = guarded_choice(self.policy, site, x, op, self.config.rounding, self.config.group_size,
                                                attention_remade="attention_output" in self.remakes.names)
        floor = self.config.floor_for(op.name) if bits and op is not None and self.config.floors else 0
        if bits and floor > bits:  # a raw choice (0) stays raw
            bits, self._why.reason = floor, f"floor for {op.name}"
        raised = self.raised.get(site) if bits and self.raised else None  # the policy's 0 (raw) stays raw
        if raised is not None and (raised == 0 or raised > bits):
            bits, self._why.reason = raised, "raised by the gradient audit"
        return bits

    def raise_bits(self, site: str, bits: int) -> None:
        """Store ``site`` at ``bits`` at least from now on (0: raw), whatever the policy gives (the gradient
        audit's widths, ``daf.runtime.audit``)."""
        if bits not in (0, 1, 2, 4, 8):
            raise ValueError(f"raise_bits takes bits in (0, 1, 2, 4, 8) (0: keep raw), got {bits!r}")
        self.raised[site] = bits

    def _op_done(self, call: OpCall) -> None:
        self._mark_made_here(nodes_made_by(tensors_in((call.output,)), call.argument_nodes))
        self.linears.note(call)
        self.norms.note(call)
        if call.saves:
            self.policy.watch_op(call)
            call.saves.clear()

    def relu_mask(self, tensor: torch.Tensor) -> "Saved | None":
        """The record of ReLU's mask of ``tensor`` stored in this forward."""
        return self._relu_masks.get(tensor)

    def hold_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """An exact copy of an attention call's mask, held for its remade probabilities."""
        return self._mask_copies.copy_of(mask)

    def _mark_made_here(self, nodes: list[Any]) -> None:
        for node in nodes:
            self._made_here[id(node)] = node

    def readable(self, node: Any) -> bool:
        """Whether ``node``'s saves went through this session's pack hook, so that reading one only names
        its record. Another hook's unpack may do anything (checkpointing's recomputes the whole block in
        forward and holds what it made until backward), so such nodes are never read."""
        return self._made_here.get(id(node)) is node

    # -- helpers ---------------------------------------------------------------------------
    def _next_seed(self) -> int:
        self._packs += 1
        return _splitmix64(self.config.seed ^ _splitmix64(self._packs)) & _MASK32

    def report(self) -> Report:
        """Figures of the last finished forward."""
        sections = {"policy": self.policy.summary(), "store": self.store.stats(),
                    "codec": {"codec": self.codecs.name, "group_size": self.config.group_size,
                              "rounding": self.config.rounding},
                    # The process's RSS depends on it as much as on DAF (docs/allocator.md): say which it is.
                    "allocator": _allocator_section()}
        sections.update({name: section() for name, section in self.sections.items()})
        return self.accounting.report(sections, self.forwards - 1 if self.forwards else None)

    def close(self) -> None:
        """Stop the packer, remove the policy's hooks and close the store to new records; idempotent.

        Records already stored stay readable until autograd releases them: backward may run after.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._collect_pending()
        finally:  # a failed background pack must not leave the worker thread and the hooks behind
            if self.packer is not None:
                self.packer.close()
            self.policy.close()
            self._recent.clear()
            self._recent_remade = None
            self._shared.clear()
            self.store.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Hooks:
    """Saved-tensor hooks of a session, plus its op tracker (on the thread that enters)."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._saved = torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack)
        self._tracker = OpTracker(session._op_done)

    def __enter__(self) -> "_Hooks":
        self._saved.__enter__()
        self._tracker.__enter__()
        self._session._trackers().append(self._tracker)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._session._trackers().remove(self._tracker)
        self._tracker.__exit__(*exc)
        self._saved.__exit__(*exc)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _not_remade(why: str, remake: Any, encoding: Encoding) -> str:
    """The report's reason for a save that could have been remade and was not."""
    if encoding.kind not in (Kind.CODES, Kind.NONZEROS, Kind.RAW):
        return why
    return (f"{why}; not remade (rule {remake.rule}): its records hold {remake.bits} bits' worth, fewer than "
            f"{'raw' if not encoding.bits else f'the {encoding.bits}'} this save gets")


def _allocator_section() -> dict[str, str]:
    """The report's allocator line: which library PyTorch's CPU tensors come from, and how it got there
    ("in-process", "preloaded" or "system"). A few microseconds (it reads /proc/self/maps)."""
    current = allocator_status()
    return {"name": current.name, "mode": current.mode}
