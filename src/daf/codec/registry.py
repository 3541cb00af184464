"""Every stored form of one session behind one object: encoders by name, decoders by packed type.

Names are what the router's ``Encoding.codec`` says: ``"codes"`` (the configured codes codec,
MinMax, DIVISION or Outliers), ``"logprobs"`` (log_softmax's output, as codes of its probabilities),
``"mask"`` (two-valued tensors, exact), ``"relu_mask"`` (ReLU's own save). A norm's input split by the
ReLU mask after it (``encode_split``) and the nonzeros of a ReLU output decode with that mask
(``decode_with_mask``).
Which codes codec a ``Config.codec`` means is a function registered for its type
(``register_codes_codec``), as torchao registers a handler per config type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from daf.codec.backends import Backend, select_backend
from daf.codec.channel import ChannelCodec, ChannelPacked
from daf.codec.derivative import DerivativePacked
from daf.codec.division import DivisionCodec, DivisionPacked
from daf.codec.logprob import LogProbCodec, LogProbPacked
from daf.codec.mask import MaskCodec, MaskPacked, ReluMaskCodec, ReluMaskPacked
from daf.codec.minmax import MinMaxCodec
from daf.codec.minmax import decode as decode_codes
from daf.codec.minmax import encode as encode_codes
from daf.codec.nonzeros import decode_nonzeros
from daf.codec.spec import Codec, Spec
from daf.codec.split import SplitPacked, decode_split, encode_split, encode_split_codes, reencode_split
from daf.config import Config, Division, MinMax, Outliers, register_config_type
from daf.format import Packed

__all__ = ["Codecs", "register_codes_codec", "codes_codec"]

_CODES_CODECS: dict[type, Callable[[Any, MinMaxCodec], Any]] = {}


def register_codes_codec(config_type: type) -> Callable:
    """Decorator: ``factory(codec_config, minmax) -> codec`` builds the codes codec for ``config_type``."""
    def register(factory: Callable[[Any, MinMaxCodec], Any]) -> Callable[[Any, MinMaxCodec], Any]:
        register_config_type("codec", config_type)
        _CODES_CODECS[config_type] = factory
        return factory
    return register


@register_codes_codec(MinMax)
def _minmax(config: MinMax, minmax: MinMaxCodec) -> MinMaxCodec:
    return minmax


@register_codes_codec(Division)
def _division(config: Division, minmax: MinMaxCodec) -> DivisionCodec:
    return DivisionCodec(minmax)


@register_codes_codec(Outliers)
def _outliers(config: Outliers, minmax: MinMaxCodec) -> ChannelCodec:
    return ChannelCodec(minmax, config)


def codes_codec(config: Config, backend: Backend | None = None) -> Any:
    """The codes codec ``config.codec`` asks for, on ``backend`` (``select_backend(config.backend)``)."""
    minmax = MinMaxCodec(config, backend if backend is not None else select_backend(config.backend))
    choice = config.codec
    factory = _CODES_CODECS.get(type(choice))
    if factory is None:
        known = ", ".join(t.__name__ for t in _CODES_CODECS)
        raise ValueError(f"Config.codec {config.codec!r} has no codec registered; registered: {known}")
    return factory(choice, minmax)


def _to_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    from daf.kernels.layout_ops import to_channels_last  # on first use: importing daf builds and loads nothing
    return to_channels_last(tensor)


class Codecs:
    """The codecs of one session. ``encode(name, x, spec)``; ``decode(packed)`` by the packed type;
    ``reencode`` (demotion) for the codes codec's records."""

    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self._config = config
        self.backend = backend if backend is not None else select_backend(config.backend)
        self.codes = codes_codec(config, self.backend)
        self._minmax = MinMaxCodec(config, self.backend)  # split records' codes: format-1 whatever the codes codec
        logprobs = LogProbCodec(self.backend, config.group_size, config.rounding)
        self._by_name: dict[str, Codec] = {"codes": self.codes, "logprobs": logprobs, "mask": MaskCodec(),
                                           "relu_mask": ReluMaskCodec()}
        # most derived first: DivisionPacked, ChannelPacked, DerivativePacked, LogProbPacked and MaskPacked are also Packed
        self._decoders: list[tuple[type, Codec]] = [(ReluMaskPacked, self._by_name["relu_mask"]),
                                                    (MaskPacked, self._by_name["mask"]), (LogProbPacked, logprobs),
                                                    (DivisionPacked, self.codes), (ChannelPacked, self.codes),
                                                    (DerivativePacked, self.codes), (Packed, self.codes)]

    @property
    def name(self) -> str:
        return self.codes.name

    def serial_twin(self) -> "Codecs":
        """The same codecs encoding on the calling thread only (for a background packer, so that it
        does not start a second team of threads beside torch's), where the backend has threads."""
        twin = getattr(self.backend, "serial_twin", None)
        return Codecs(self._config, twin()) if twin is not None else self

    def __getitem__(self, name: str) -> Codec:
        return self._by_name[name]

    def encode(self, name: str, x: torch.Tensor, spec: Spec) -> Packed:
        return self._by_name[name].encode(x, spec)

    def readers(self, name: str, x: torch.Tensor, spec: Spec) -> frozenset[str] | None:
        """The ops that may share the record ``encode(name, x, spec)`` makes, when its decoded tensor is
        not ``x`` for every reader (a codec says so with a ``readers(x, spec)`` method); None: any op."""
        check = getattr(self._by_name[name], "readers", None)
        return None if check is None else check(x, spec)

    def decode(self, packed: Packed, channels_last: bool = False) -> torch.Tensor:
        """The tensor of ``packed``; with ``channels_last``, a 4-D one comes back in that layout (format-1
        codes decoded straight into it, other records copied by ``to_channels_last``)."""
        if channels_last and type(packed) is Packed:  # every codes codec decodes plain format-1 as minmax does
            tensor = decode_codes(packed, self.backend, channels_last=True)
        elif channels_last and isinstance(packed, MaskPacked):  # the mask kernels write that layout themselves
            tensor = self._decoder_of(packed).decode(packed, channels_last=True)
        else:
            tensor = self._decoder_of(packed).decode(packed)
        return _to_channels_last(tensor) if channels_last and tensor.dim() == 4 else tensor

    def encode_held(self, x: torch.Tensor, bits: int) -> Packed:
        """Format-1 codes of ``x`` (nearest, whatever the codes codec): what a norm input waiting for its ReLU
        is held as (``daf.runtime.held``)."""
        return encode_codes(x, bits, self._config.group_size, "nearest", 0, self.backend)

    def encode_split(self, x: torch.Tensor, mask: MaskPacked, spec: Spec) -> SplitPacked | None:
        """``x`` split by ``mask`` (the record of the ReLU mask after it): codes at ``spec.bits`` of the
        masked-in elements, group means of the others (``daf.codec.split``)."""
        return encode_split(x, mask, lambda flat: self._minmax.encode(flat, spec), self._config.group_size)

    def encode_split_held(self, held: Packed, mask: MaskPacked, spec: Spec) -> SplitPacked | None:
        """``encode_split`` of what ``encode_held`` codes hold, decoded a chunk at a time (never whole)."""
        return encode_split_codes(held, mask, self.decode, lambda flat: self._minmax.encode(flat, spec),
                                  self._config.group_size)

    def decode_with_mask(self, packed: Packed, mask: MaskPacked, site: str, channels_last: bool = False) -> torch.Tensor:
        """A record that needs the ReLU mask ``mask`` to decode: a split norm input, or a ReLU output's nonzeros."""
        if isinstance(packed, SplitPacked):
            tensor = decode_split(packed, mask, self._minmax.decode, site)
        else:
            tensor = decode_nonzeros(packed, mask, site, self.decode)
        return _to_channels_last(tensor) if channels_last and tensor.dim() == 4 else tensor

    def _decoder_of(self, packed: Packed) -> Codec:
        if isinstance(packed, SplitPacked):
            raise TypeError("a SplitPacked record decodes with the ReLU mask it was split by: Codecs.decode_with_mask")
        for packed_type, codec in self._decoders:
            if isinstance(packed, packed_type):
                return codec
        raise TypeError(f"DAF has no codec for a record of type {type(packed).__name__}")

    def reencode(self, packed: Packed, bits: int, seed: int) -> Packed:
        """``packed`` at fewer ``bits`` (demotion), by the codec that decodes it."""
        if isinstance(packed, SplitPacked):
            return reencode_split(packed, lambda codes: self._minmax.reencode(codes, bits, seed))
        return self._decoder_of(packed).reencode(packed, bits, seed)
