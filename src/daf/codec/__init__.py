"""Compression of one tensor: every stored form is a codec, ``encode(tensor, spec)`` / ``decode(packed)``."""

from daf.codec.backends import REFERENCE, Backend, select_backend
from daf.codec.channel import ChannelCodec, ChannelPacked
from daf.codec.derivative import DerivativeCodec, DerivativePacked
from daf.codec.division import DivisionCodec, DivisionPacked
from daf.codec.mask import MaskCodec, MaskPacked, ReluMaskCodec
from daf.codec.minmax import MinMaxCodec, decode, encode
from daf.codec.registry import Codecs, codes_codec, register_codes_codec
from daf.codec.spec import Codec, Spec
from daf.format import Packed

__all__ = ["encode", "decode", "Codec", "Spec", "Codecs", "MinMaxCodec", "DivisionCodec", "DivisionPacked",
           "MaskCodec", "ReluMaskCodec", "MaskPacked", "codes_codec", "register_codes_codec", "Packed",
           "Backend", "REFERENCE", "select_backend", "ChannelCodec", "ChannelPacked", "DerivativeCodec",
           "DerivativePacked"]
