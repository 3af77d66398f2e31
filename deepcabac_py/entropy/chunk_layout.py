"""How a tensor is cut into substreams, and the ``coder_param`` byte of its table entry that says
how the level coder models them: this part of the stream format (``docs/format.md`` §4), defined
once, for the writer, the reader and the container's validation.

A tensor is viewed as a row-major matrix (dim0 x the rest) and cut into chunks of whole rows of at
most :data:`CHUNK_ELEMENTS` elements (a row longer than that is cut into pieces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._cabac_kernels import DEFAULT_K_OFFSET, PREDICT_MAX_LEVEL

CHUNK_ELEMENTS = 1 << 20
MAX_K_OFFSET = 7
PREDICT_BIT = 0x10  # coder_param = k_offset | PREDICT_BIT when column prediction is on
# The chunks code the residuals of a linear prediction across columns (linear_prediction.py) with
# neither column model nor column prediction; the tensor's first substream is the predictor.
LINEAR_BIT = 0x20
# The column model is switched off although the rows fit in a chunk (format version 3): where the
# rows' scales differ much more than the columns', averaging in a column scale only blurs the row's.
NO_COLUMNS_BIT = 0x08
SWITCH_BITS = PREDICT_BIT | LINEAR_BIT | NO_COLUMNS_BIT


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
