"""Entropy coding of integer level arrays: the validated front of the Numba kernels.

A tensor is viewed as a row-major matrix (dim0 x the rest) and cut into chunks of whole rows of at
most :data:`CHUNK_ELEMENTS` elements (a row longer than that is cut into pieces). Each chunk is an
independent arithmetic-coded substream, so the chunks of one tensor encode and decode in parallel
and a damaged chunk cannot take its neighbours with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptStreamError
from . import _cabac_kernels
from ._cabac_kernels import LEVEL_MAX, PREDICT_MAX_LEVEL

CHUNK_ELEMENTS = 1 << 20
DEFAULT_K_OFFSET = _cabac_kernels.DEFAULT_K_OFFSET
MAX_K_OFFSET = 7
PREDICT_BIT = 0x10  # coder_param = k_offset | PREDICT_BIT when column prediction is on
# The chunks code the residuals of a linear prediction across columns (linear_prediction.py) with
# neither column model nor column prediction; the tensor's first substream is the predictor.
LINEAR_BIT = 0x20
# The column model is switched off although the rows fit in a chunk (format version 3): where the
# rows' scales differ much more than the columns', averaging in a column scale only blurs the row's.
NO_COLUMNS_BIT = 0x08
SWITCH_BITS = PREDICT_BIT | LINEAR_BIT | NO_COLUMNS_BIT

_ERRORS = {
    _cabac_kernels.ERR_BAD_START: "the substream does not start with a valid code value",
    _cabac_kernels.ERR_BAD_ESCAPE: "an escape code is longer than any level allows",
    _cabac_kernels.ERR_BAD_VALUE: "a decoded level exceeds the 31-bit range",
    _cabac_kernels.ERR_BAD_TERMINATE: "the substream does not end where its levels end (bad terminate bin)",
    _cabac_kernels.ERR_OVERRUN: "the substream is shorter than its levels need (truncated)",
    _cabac_kernels.ERR_BAD_BYPASS: "a bypass code word is out of range",
}


@dataclass(frozen=True)
class ChunkLayout:
    """How a tensor of ``numel`` elements is cut into substreams."""

    numel: int
    ncols: int  # columns of the 2-D view when the column model is used, else 0
    chunk_elements: int
    k_offset: int = DEFAULT_K_OFFSET  # Rice parameter offset in half octaves (0..MAX_K_OFFSET)
    predict: bool = False  # column prediction (only with the column model)
    linear: bool = False  # the levels are residuals of a linear prediction (then ncols is 0)
    no_columns: bool = False  # the column model is off by choice (then ncols is 0)

    @property
    def coder_param(self) -> int:
        """The byte that stores k_offset and the switches in the tensor table."""
        return (self.k_offset | (PREDICT_BIT if self.predict else 0) | (LINEAR_BIT if self.linear else 0)
                | (NO_COLUMNS_BIT if self.no_columns else 0))

    @property
    def count(self) -> int:
        return -(-self.numel // self.chunk_elements) if self.numel else 0

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_elements
        return start, min(self.numel, start + self.chunk_elements)

    def size(self, index: int) -> int:
        start, stop = self.bounds(index)
        return stop - start

    def first_column(self, start: int) -> int:
        return start % self.ncols if self.ncols else 0


def _numel_and_columns(shape: tuple[int, ...]) -> tuple[int, int]:
    numel = math.prod(int(d) for d in shape)
    rows = int(shape[0]) if len(shape) >= 2 else 1
    return numel, (numel // rows if rows > 1 and numel else 0)


def layout_for_shape(shape: tuple[int, ...], target: int = CHUNK_ELEMENTS,
                     k_offset: int = DEFAULT_K_OFFSET, max_abs_level: int = 0, predict: bool = True,
                     columns: bool = True) -> ChunkLayout:
    """The chunk layout the encoder chooses for a tensor of ``shape``: whole rows when they fit,
    the column model unless ``columns`` is False, column prediction wherever the column model runs,
    the levels allow it and ``predict`` asks."""
    numel, ncols = _numel_and_columns(shape)
    size = (target // ncols) * ncols if ncols and ncols <= target else target
    layout = layout_from_stream(shape, max(1, size), k_offset)
    if layout.ncols and not columns:
        return ChunkLayout(layout.numel, 0, layout.chunk_elements, k_offset, no_columns=True)
    if layout.ncols and max_abs_level <= PREDICT_MAX_LEVEL and predict:
        layout = ChunkLayout(layout.numel, layout.ncols, layout.chunk_elements, k_offset, predict=True)
    return layout


def layout_from_stream(shape: tuple[int, ...], chunk_elements: int, coder_param: int) -> ChunkLayout:
    """The layout a stream declares (any positive chunk size decodes).

    The column model needs at least one whole row per chunk; with longer rows it is off (ncols 0),
    which also bounds its per-chunk state by the chunk size.
    """
    numel, ncols = _numel_and_columns(shape)
    linear = bool(coder_param & LINEAR_BIT)
    no_columns = bool(coder_param & NO_COLUMNS_BIT)
    if ncols > chunk_elements or linear or no_columns:
        ncols = 0
    return ChunkLayout(numel=numel, ncols=ncols, chunk_elements=chunk_elements,
                       k_offset=coder_param & ~SWITCH_BITS, predict=bool(coder_param & PREDICT_BIT),
                       linear=linear, no_columns=no_columns)


def row_length(shape: tuple[int, ...]) -> int:
    """Elements per row of the 2-D view (dim0 x the rest); 0 below two dimensions."""
    return _numel_and_columns(shape)[1]


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
