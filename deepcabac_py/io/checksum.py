"""The CRC-32 of the stream formats (zlib's polynomial, so ``zlib.crc32`` computes the same values).

Where the processor has VPCLMULQDQ and AVX2 but not AVX-512, large buffers go through this
package's own kernel (:mod:`._checksum_kernels`: 23 GB/s on a Zen 3, ISA-L 12.7 there: MiniLM's
checksums had taken a tenth of its lossless decoding). With AVX-512, ISA-L folds 64 bytes to an
instruction and wins (an Intel Xeon with AVX-512: 100 against the kernel's 52 GB/s on 1 MB in the
cache, 29 against 26 from memory). Elsewhere ISA-L's implementation, or zlib's (3.8 GB/s) where the
isal package is missing (an install with ``--no-deps`` on a platform without its wheel): the
kernel then runs wherever it can.
"""

from __future__ import annotations

import numpy as np

from .._jit import host_features
from . import _checksum_kernels as _k

try:
    from isal.isal_zlib import crc32 as _library_crc32
    _ISAL = True
except ImportError:  # pragma: no cover
    from zlib import crc32 as _library_crc32
    _ISAL = False

__all__ = ["crc32"]

FOLD_FROM = 1 << 16  # bytes: below, a call into the kernel costs more than it saves
CAN_FOLD = {"+avx2", "+vpclmulqdq"} <= host_features()  # (the kernel's instructions)
# (the AVX-512 ISA-L dispatches to its 64-byte folding on)
_ISAL_WIDE = _ISAL and {"+avx512f", "+avx512vl", "+avx512bw", "+avx512dq", "+vpclmulqdq"} <= host_features()
FOLDING = CAN_FOLD and not _ISAL_WIDE  # (large buffers go to the kernel)
_MULTIPLIERS = _k.fold_constants()
_TABLE = _k.byte_table()


def crc32(data, value: int = 0) -> int:
    """zlib's ``crc32(data, value)`` of a contiguous bytes-like ``data``."""
    if FOLDING:
        view = np.frombuffer(data, dtype=np.uint8)
        if view.shape[0] >= FOLD_FROM:
            view.flags.writeable = False  # (one compiled type whatever the buffer)
            return int(_k.crc32_folded(view, value, _MULTIPLIERS, _TABLE))
    return _library_crc32(data, value)
