"""Entropy coding of integer level arrays: the validated front of the Numba kernels.

Each chunk of a tensor (:mod:`.chunk_layout`) is an independent arithmetic-coded substream, so the
chunks of one tensor encode and decode in parallel and a damaged chunk cannot take its neighbours
with it.
"""

from __future__ import annotations

import numpy as np

from .._jit import not_yet_compiled
from ..errors import CorruptStreamError
from . import _cabac_kernels
from ._cabac_kernels import LEVEL_MAX, PREDICT_MAX_LEVEL
from .chunk_layout import ChunkLayout

_ERRORS = {
    _cabac_kernels.ERR_BAD_START: "the substream does not start with a valid code value",
    _cabac_kernels.ERR_BAD_ESCAPE: "an escape code is longer than any level allows",
    _cabac_kernels.ERR_BAD_VALUE: "a decoded level exceeds the 31-bit range",
    _cabac_kernels.ERR_BAD_TERMINATE: "the substream does not end where its levels end (bad terminate bin)",
    _cabac_kernels.ERR_OVERRUN: "the substream is shorter than its levels need (truncated)",
    _cabac_kernels.ERR_BAD_BYPASS: "a bypass code word is out of range",
}


def first_call_compiles(decoder: bool) -> bool:
    """Whether the first decode (``decoder``) or encode of this process compiles the coder's kernels."""
    return not_yet_compiled(_cabac_kernels.decode_levels_kernel if decoder else _cabac_kernels.encode_levels_kernel)


def max_elements_for_payload(nbytes: int) -> int:
    """An upper bound on how many levels ``nbytes`` of substream can hold.

    Used to refuse headers whose shapes would make the decoder allocate far more than the payload
    can describe.
    """
    bits = (nbytes + _cabac_kernels.OVERRUN_SLACK + 1) * 8
    return int(bits / _cabac_kernels.MIN_BITS_PER_ELEMENT) + 1


def encode_chunk(part: np.ndarray, layout: ChunkLayout, index: int) -> bytes:
    """Encode ``part``, the flat int32 levels of the ``index``-th chunk of a tensor."""
    start, stop = layout.bounds(index)
    if part.dtype != np.int32 or part.shape != (stop - start,):
        raise ValueError(f"chunk {index} needs a flat int32 array of {stop - start} levels")
    check_levels(part)
    if layout.predict and part.size and max(-int(part.min()), int(part.max())) > PREDICT_MAX_LEVEL:
        raise ValueError(f"column prediction needs |level| <= {PREDICT_MAX_LEVEL}")
    return run_encoder(part.shape[0], lambda out: _cabac_kernels.encode_levels_kernel(
        part, layout.ncols, layout.first_column(start), layout.k_offset, layout.predict, out))


def run_encoder(n: int, encode) -> bytes:
    """The substream of ``n`` levels that ``encode(out)`` writes into a byte buffer ``out`` (a kernel
    call returning the byte count, or -1 when ``out`` is too small)."""
    # A generous first guess; a pathological chunk gets a second try with room for any level.
    capacity = n * 5 + 64
    while True:
        out = np.empty(capacity, dtype=np.uint8)
        size = encode(out)
        if size >= 0:
            break
        if capacity >= n * 48 + 256:
            raise RuntimeError("internal error: the level coder needs more than 48 bytes per level")
        capacity = n * 48 + 256
    # The first byte of the range coder's output is always zero: it is not stored.
    return out[1:size].tobytes()


def decode_chunk(payload, layout: ChunkLayout, index: int, out: np.ndarray) -> None:
    """Decode the ``index``-th chunk from ``payload`` (bytes-like) into ``out``, a flat int32 array
    of exactly the chunk's length.

    Raises :class:`CorruptStreamError` if the substream is inconsistent.
    """
    start, stop = layout.bounds(index)
    if out.dtype != np.int32 or out.shape != (stop - start,):
        raise ValueError(f"out must be a flat int32 array of {stop - start} elements")
    buf = np.frombuffer(payload, dtype=np.uint8)
    if stop - start > max_elements_for_payload(buf.shape[0]):
        raise CorruptStreamError(
            f"chunk {index} claims {stop - start} levels but its {buf.shape[0]} bytes cannot hold them"
        )
    status = _cabac_kernels.decode_levels_kernel(buf, layout.ncols, layout.first_column(start), layout.k_offset,
                                     layout.predict, out)
    if status != _cabac_kernels.OK:
        raise CorruptStreamError(f"chunk {index}: {_ERRORS.get(status, 'corrupt substream')}")


def check_levels(levels: np.ndarray) -> None:
    """Raise ``ValueError`` unless ``levels`` fit the coder (|level| <= 2**31 - 1)."""
    if levels.size and int(levels.min()) < -LEVEL_MAX:
        raise ValueError("levels must lie in [-(2**31 - 1), 2**31 - 1]")
