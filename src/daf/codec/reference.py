"""The reference codec now lives beside the kernels (``daf.kernels.reference``); this name stays for callers.

Importing it imports ``daf.kernels.reference`` only: no native build.
"""

from daf.kernels.reference import (  # noqa: F401
    CHUNK_ELEMENTS,
    decode_flat,
    encode_flat,
    exception_table,
    mix32,
    round_down_bf16,
    round_up_bf16,
    uniform_noise,
)

__all__ = ["encode_flat", "decode_flat", "exception_table", "uniform_noise", "mix32"]
