"""The CRC-32 of the stream formats (zlib's polynomial, so ``zlib.crc32`` computes the same values).

ISA-L's implementation runs at memory speed (about 25 GB/s here against zlib's 2): without it, the
checksums of a lossless stream took a tenth of its decoding time. zlib's stands in where the isal
package is missing (an install with ``--no-deps`` on a platform without its wheel).
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover
    from zlib import crc32

__all__ = ["crc32"]
