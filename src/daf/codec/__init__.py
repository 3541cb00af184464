"""Compression of one tensor: the format-1 codec, its reference and its backends."""

from daf.codec.api import Codec, decode, encode, make_codec
from daf.codec.backends import REFERENCE, Backend, select_backend
from daf.format import Packed

__all__ = ["encode", "decode", "Codec", "make_codec", "Packed", "Backend", "REFERENCE", "select_backend"]
