"""How one tensor is coded: its table entry, chunk layout, quantizer and importance, and the
levels of its chunks.

:class:`TensorPlanner` turns a tensor into a :class:`TensorPlan` (quantized floats, lossless
integers, or raw bytes); the plan quantizes and codes its own chunks, which are independent: the
encoder runs them on a thread pool.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..entropy import chunk_layout, floatcoder, levelcoder, linear_prediction
from ..entropy.levelcoder import LEVEL_MAX
from ..errors import DeepCabacWarning
from ..io.checkpoint import tensor_to_numpy
from ..io.dtypes import DType
from ..quant import quantizers
from ..quant.log_domain import LOG_DTYPES, log_levels
from ..quant.reconstruct import fits
from ..quant.steps import QP_MIN, qp_for_range, step_from_qp
from . import _planning_kernels, optimizer_state
from .container import FLAG_TORCH, Coder, Mode, TensorEntry
from .levels import QuantizedTensor, assembled
from .settings import EncodeSettings, lookup_qp

# Within a tensor, importance is smoothed towards its mean: (importance / mean + FLOOR) / (1 + FLOOR).
# A weight the calibration data never exercised (an embedding row of a token it did not contain)
# has zero measured importance, but other data will need it; and a diagonal Fisher from a few
# batches is noisy (floors of 2-5 measured best: docs/design-notes.md).
IMPORTANCE_FLOOR = 2.0

# Column prediction (the level coder's switch to coding a row against the running mean of the rows
# above) pays where neighbouring rows look alike: position embeddings, the untrained rows of a word
# embedding. Elsewhere it never switches on and costs time in both directions. Large tensors get it
# only when at least this share of sampled rows is clearly closer to the row above than to zero (by
# the coder's own switching margin).
PREDICT_MIN_SHARE = 0.02
PREDICT_MARGIN = 0.875
PREDICT_SAMPLE_ROWS = 128
PREDICT_TEST_MIN_ELEMENTS = 1 << 16  # smaller tensors keep both: the test would cost what it saves
# The column model's scale is the mean of a row scale and a column scale. Where the rows' mean
# magnitudes spread much more than the columns' (standard deviations of their logs, on the sampled
# rows), the column scale only blurs the row's: then the model is off.
NO_COLUMNS_MIN_RATIO = 1.5


@dataclass(frozen=True)
class Importance:
    """A tensor's importance as given (possibly a broadcast view: no copy the size of the tensor)
    and its mean; the smoothed relative weights are made chunk by chunk."""

    array: np.ndarray
    mean: float

    def chunk(self, start: int, stop: int) -> np.ndarray:
        a = self.array
        rows = a.shape[0] if a.ndim else 1
        per_row = a.size // rows if rows else 0
        if a.ndim >= 2 and per_row and start % per_row == 0 and stop % per_row == 0:
            part = a[start // per_row:stop // per_row].reshape(-1)  # whole rows: only the chunk is materialised
        else:
            part = a.reshape(-1)[start:stop]
        if part.dtype not in (np.float32, np.float64):
            part = part.astype(np.float64)
        out = np.empty(part.shape[0], dtype=np.float32)
        _planning_kernels.relative_importance(part, self.mean, IMPORTANCE_FLOOR, out)
        return out


def importance_array(importance) -> np.ndarray:
    """An importance as a numpy array, as given (no float64 copy: a broadcast view stays a view)."""
    if not isinstance(importance, np.ndarray) and hasattr(importance, "detach"):
        importance = importance.detach().cpu().numpy()
    imp = np.asarray(importance)
    if imp.dtype.kind not in "fiub":
        raise ValueError(f"importance must be numbers, got dtype {imp.dtype}")
    return imp


def relative_importance(name: str, importance, shape: tuple[int, ...]) -> Importance | None:
    """The per-weight importance of tensor ``name``, or None where it would not change a level."""
    if importance is None:
        return None
    imp = importance_array(importance)
    # min and max instead of isfinite(): no temporary the size of the tensor (a NaN fails lo >= 0)
    lo, hi = (float(imp.min()), float(imp.max())) if imp.size else (0.0, 0.0)
    if not (lo >= 0 and np.isfinite(hi)):
        raise ValueError(f"importance of {name!r} must be finite and non-negative")
    if imp.ndim == 0:  # one number for the whole tensor: it only moves the tensor's step
        return None
    if imp.shape != tuple(shape):
        raise ValueError(f"importance of {name!r} has shape {imp.shape}, the tensor has {tuple(shape)}")
    mean = float(imp.mean(dtype=np.float64)) if imp.size else 0.0
    if mean <= 0.0:
        return None
    return Importance(imp, mean)


# Signed integers this wide on average (bits of |v|) go to the magnitude coder: the level coder's
# escape codes cost a few bits per value more there (differences of float bits, as a lossless
# checkpoint series makes), and it cannot hold |v| >= 2**31 at all.
WIDE_MEAN_BITS = 12
WIDE_MIN_ELEMENTS = 4096  # (smaller ones: the magnitude coder's tables would cost what it saves)


def _wide(arr: np.ndarray, lo: int, hi: int) -> bool:
    if lo < -LEVEL_MAX or hi > LEVEL_MAX:
        return True
    if max(-lo, hi) < 1 << WIDE_MEAN_BITS or arr.size < WIDE_MIN_ELEMENTS:
        return False
    flat = np.ascontiguousarray(arr).reshape(-1)
    mean = np.empty(1, dtype=np.float64)
    floatcoder.mean_bit_length(flat, mean)
    return float(mean[0]) >= WIDE_MEAN_BITS


@dataclass
class TensorPlan:
    """How one tensor is coded, and the means to quantize and code its chunks."""

    entry: TensorEntry
    array: np.ndarray | None  # the values (numpy carrier), None for aliases
    layout: chunk_layout.ChunkLayout | None = None  # None: stored raw (or an alias)
    quantizer: str = "nearest"
    lam: float = 0.0
    importance: Importance | None = None  # per-weight importance, relative to its mean
    linear: linear_prediction.LinearPredictor | None = None  # codes residuals of this prediction
    levels: np.ndarray | None = None  # the whole tensor's levels (flat int32) when ``linear`` is set
    max_level: int = 0  # a bound on |level| of a quantized tensor
    floats: np.ndarray | None = None  # a quantized tensor's values as the quantizer reads them (flat)
    log_offset: int | None = None  # Mode.LOG: the offset of its levels (``levels`` holds them)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def values(self) -> np.ndarray:
        """The tensor's values (every plan but an alias's has them)."""
        if self.array is None:
            raise RuntimeError(f"internal error: the alias {self.name!r} has no values of its own")
        return self.array

    @property
    def chunks(self) -> chunk_layout.ChunkLayout:
        """The chunk layout of a level-coded tensor."""
        if self.layout is None:
            raise RuntimeError(f"internal error: {self.name!r} is not level-coded")
        return self.layout

    @property
    def is_level_coded(self) -> bool:
        return self.layout is not None

    @property
    def is_chunked(self) -> bool:
        """Coded in independent substreams (level-coded, Mode.FLOAT or MAGNITUDE), not stored raw."""
        return self.layout is not None or self.entry.mode.is_class_coded

    @property
    def chunk_count(self) -> int:
        e = self.entry
        return e.even_chunk_count if e.mode.is_class_coded else self.chunks.count

    def chunk_size(self, k: int) -> int:
        e = self.entry
        if e.mode.is_class_coded:
            start, stop = e.even_chunk_bounds(k)
            return stop - start
        return self.chunks.size(k)

    @property
    def is_quantized(self) -> bool:
        return self.layout is not None and self.entry.mode.is_quantized

    def _quantizer_inputs(self, start: int, stop: int):
        """The float values of a quantized chunk, its step, and its relative importance (or None)."""
        if self.floats is not None:
            floats = self.floats[start:stop]
        else:
            floats = _as_float_for_quantizer(self.values.reshape(-1)[start:stop], self.entry.dtype)
        # nearest rounding has no use for it: no pass over the chunk's importance then
        weighted = self.importance is not None and self.quantizer != "nearest"
        imp = self.importance.chunk(start, stop) if self.importance is not None and weighted else None
        return floats, step_from_qp(self.entry.qp, self.entry.qp_density), imp

    def chunk_levels(self, start: int, stop: int) -> np.ndarray:
        """The levels of elements ``start:stop`` (a chunk), as the encoder quantizes them."""
        entry = self.entry
        if entry.mode == Mode.LOG and self.levels is not None:
            return self.levels[start:stop]
        if entry.mode.is_quantized:
            values, step, imp = self._quantizer_inputs(start, stop)
            if self.quantizer == "nearest":
                return quantizers.quantize_nearest(values, step)
            layout = self.chunks
            return quantizers.quantize_rd(values, step, method=self.quantizer, lam=self.lam, ncols=layout.ncols,
                                          col0=layout.first_column(start), k_offset=layout.k_offset,
                                          predict=layout.predict, importance=imp)
        flat = self.values.reshape(-1)[start:stop]
        if entry.dtype == DType.BOOL:
            return flat.view(np.uint8).astype(np.int32)
        return flat.astype(np.int32)

    def quantized(self) -> QuantizedTensor:
        """The tensor's levels, chunk by chunk as the encoder quantizes them (the RD quantizers and
        the trellis state restart with every substream)."""
        layout = self.chunks
        return assembled(self.entry, [self.chunk_levels(*layout.bounds(k)) for k in range(layout.count)])

    def encode_chunk(self, k: int) -> tuple[floatcoder.Buffer, np.ndarray | None]:
        """Chunk ``k``'s substream and its levels (the transmitted levels of trellis chunks; None for
        Mode.FLOAT)."""
        e = self.entry
        if e.mode.is_class_coded:
            start, stop = e.even_chunk_bounds(k)
            part = self.values.reshape(-1)[start:stop]
            seg = floatcoder.segment_length(e.shape)
            if e.mode == Mode.MAGNITUDE:
                return floatcoder.encode_magnitudes(part, seg), None
            return floatcoder.encode_chunk_buffer(part, e.dtype.dtype_name, seg), None
        layout = self.chunks
        start, stop = layout.bounds(k)
        if self.linear is not None and self.levels is not None:
            levels = self.levels[start:stop]
            return levelcoder.encode_chunk(self.linear.residuals(levels), layout, k), levels
        if self.entry.mode.is_quantized and self.quantizer == "trellis":
            # one pass: the trellis codes each block as it commits it
            values, step, imp = self._quantizer_inputs(start, stop)
            levels = np.empty(stop - start, dtype=np.int32)
            data = quantizers.trellis_encode_chunk(values, step, lam=self.lam, layout=layout, index=k,
                                                   importance=imp, levels=levels)
            return data, levels
        levels = self.chunk_levels(start, stop)
        return levelcoder.encode_chunk(levels, layout, k), levels

    def with_linear_prediction(self) -> TensorPlan:
        """The plan with a linear prediction across columns where one qualifies and pays. Nearest
        rounding and RDOQ (their levels are chosen by the plain coder's rates, then coded either
        way); not the trellis, which codes each block as it chooses it."""
        e, layout = self.entry, self.layout
        if (layout is None or self.linear is not None or e.mode != Mode.UNIFORM
                or self.quantizer not in ("nearest", "rdoq") or len(e.shape) < 2):
            return self
        ncols = chunk_layout.row_length(e.shape)
        if not linear_prediction.qualifies(e.numel // max(ncols, 1), ncols) or layout.chunk_elements % ncols:
            return self
        if self.quantizer == "nearest":  # rounding does not depend on the chunks: one pass
            levels = self.chunk_levels(0, e.numel)
        else:  # chunk by chunk, exactly as they would be coded without the prediction
            levels = self.quantized().levels.reshape(-1)
        with linear_prediction.blas_threads(True):
            predictor = linear_prediction.fit(levels, ncols, level_bound=self.max_level)
        if predictor is None:
            return self
        linear = chunk_layout.ChunkLayout(layout.numel, 0, layout.chunk_elements, layout.k_offset, linear=True)
        entry = dataclasses.replace(e, coder_param=linear.coder_param)
        return dataclasses.replace(self, entry=entry, layout=linear, linear=predictor, levels=levels)


@dataclass(frozen=True)
class TensorPlanner:
    """Plans tensors with a model's resolved settings: qp per tensor (overrides, allocation) and
    per-weight importance."""

    settings: EncodeSettings
    overrides: Mapping[str, int]  # qp per tensor name or pattern, allocation included
    importance: Mapping[str, Any]  # per-weight importance by tensor name, as resolved for the model
    roles: Mapping[str, str] = field(default_factory=dict)  # optimizer-state roles (optimizer_state.roles)

    def plan(self, name: str, tensor) -> TensorPlan:
        p = self._plan(name, tensor)
        e = p.entry
        # what is kept exact is coded losslessly where the float coder takes its dtype
        if e.mode == Mode.RAW and e.numel and e.dtype.dtype_name in floatcoder.FORMATS:
            e.mode, e.coder = Mode.FLOAT, Coder.FLOAT_CLASSES
            e.chunk_elements = floatcoder.chunk_elements(e.shape)
        return p

    def _plan(self, name: str, tensor) -> TensorPlan:
        s = self.settings
        arr, dtype_name, is_torch = tensor_to_numpy(tensor)
        dtype = DType.from_name(dtype_name)
        entry = TensorEntry(name=name, dtype=dtype, shape=tuple(map(int, arr.shape)), mode=Mode.RAW,
                            flags=FLAG_TORCH if is_torch else 0)
        if arr.size == 0:
            return TensorPlan(entry, arr)
        if dtype.is_float and not s.is_exact(name):
            role = self.roles.get(name)
            if role is None:
                return self._plan_float(entry, arr)
            if role != optimizer_state.EXACT:  # a moment: in the log domain, or exact in half precision
                return self._plan_log(entry, arr) if dtype_name in LOG_DTYPES else TensorPlan(entry, arr)
        if dtype.is_float or dtype.is_complex:
            return TensorPlan(entry, arr)
        if dtype == DType.UINT64 and int(arr.max()) > LEVEL_MAX:
            return TensorPlan(entry, arr)
        lo, hi = _planning_kernels.int_range(arr.reshape(-1).view(np.uint8) if dtype == DType.BOOL else arr.reshape(-1))
        if dtype_name in floatcoder.INTEGER_WIDTHS and _wide(arr, lo, hi):
            entry.mode, entry.coder = Mode.MAGNITUDE, Coder.FLOAT_CLASSES
            entry.chunk_elements = floatcoder.chunk_elements(entry.shape)
            return TensorPlan(entry, arr)
        if lo < -LEVEL_MAX or hi > LEVEL_MAX:
            return TensorPlan(entry, arr)
        entry.mode, entry.coder = Mode.INTEGER, Coder.ADAPTIVE_SCALE
        layout = chunk_layout.layout_for_shape(entry.shape, max_abs_level=max(-int(lo), int(hi)))
        entry.chunk_elements = layout.chunk_elements
        entry.coder_param = layout.coder_param
        return TensorPlan(entry, arr, layout)

    def _plan_float(self, entry: TensorEntry, arr: np.ndarray) -> TensorPlan:
        s, name = self.settings, entry.name
        if entry.dtype == DType.BFLOAT16:
            # (the chunks convert their own part: no float32 copy of the whole tensor)
            values = None
            top, finite = _planning_kernels.bfloat16_range(arr.reshape(-1))
        else:
            values = _as_float_for_quantizer(arr, entry.dtype)
            top, finite = _planning_kernels.float_range(values)
        if not finite:
            warnings.warn(f"{name}: holds NaN or infinity; stored exactly", DeepCabacWarning, stacklevel=5)
            return TensorPlan(entry, arr)
        chosen = lookup_qp(name, self.overrides)
        if chosen is None:
            chosen = s.qp_1d_resolved if arr.ndim <= 1 else s.qp
        qp = _qp_that_holds(float(top), chosen, s.qp_density, entry.dtype.dtype_name, s.dependent)
        if qp is None:
            warnings.warn(f"{name}: values up to {top:g} do not fit 31-bit levels at any qp of density "
                          f"{s.qp_density}; stored exactly", DeepCabacWarning, stacklevel=5)
            return TensorPlan(entry, arr)
        if qp > chosen:
            warnings.warn(f"{name}: values up to {top:g} need qp {qp} instead of {chosen} for 31-bit levels; "
                          f"its weights below {step_from_qp(qp, s.qp_density) / 2:g} are coded as 0",
                          DeepCabacWarning, stacklevel=5)
        entry.qp = qp
        entry.qp_density = s.qp_density
        entry.mode = Mode.DEPENDENT if s.dependent else Mode.UNIFORM
        entry.coder = Coder.ADAPTIVE_SCALE
        max_level = int(float(top) / step_from_qp(entry.qp, s.qp_density) + 0.5)
        if s.dependent:
            max_level = max_level // 2 + 1
        columns, predict = _column_choices(arr, entry.dtype, entry.shape)
        layout = chunk_layout.layout_for_shape(entry.shape, max_abs_level=max_level, predict=predict, columns=columns)
        entry.chunk_elements = layout.chunk_elements
        entry.coder_param = layout.coder_param
        # (converted once, but for bfloat16: the chunks read their part of it)
        return TensorPlan(entry, arr, layout, s.quantizer, s.lam,
                          relative_importance(name, self.importance.get(name), arr.shape), max_level=max_level,
                          floats=values)


    def _plan_log(self, entry: TensorEntry, arr: np.ndarray) -> TensorPlan:
        s = self.settings
        qp = lookup_qp(entry.name, s.qp_overrides or {})
        qp = s.moments_qp if qp is None else qp
        _, finite = _planning_kernels.float_range(arr.reshape(-1))
        if not finite:
            warnings.warn(f"{entry.name}: holds NaN or infinity; stored exactly", DeepCabacWarning, stacklevel=5)
            return TensorPlan(entry, arr)
        try:
            levels, offset = log_levels(arr, step_from_qp(qp, s.qp_density))
        except ValueError:
            return TensorPlan(entry, arr)
        entry.mode, entry.coder, entry.qp, entry.qp_density = Mode.LOG, Coder.ADAPTIVE_SCALE, qp, s.qp_density
        max_level = int(np.abs(levels).max()) if levels.size else 0
        layout = chunk_layout.layout_for_shape(entry.shape, max_abs_level=max_level, predict=False)
        entry.chunk_elements = layout.chunk_elements
        entry.coder_param = layout.coder_param
        return TensorPlan(entry, arr, layout, levels=levels, max_level=max_level, log_offset=offset)


def _qp_that_holds(top: float, qp: int, qp_density: int, dtype: str, dependent: bool) -> int | None:
    """The qp nearest ``qp`` whose levels for values up to ``top`` fit 31 bits and whose largest
    reconstruction is a finite value of ``dtype`` (near the dtype's largest value a coarse step rounds
    beyond it: then finer ones are tried); None if there is none."""
    try:
        qp = qp_for_range(top, qp, qp_density)
    except ValueError:
        return None
    while True:
        step = step_from_qp(qp, qp_density)
        level = int(top / step + 0.5)
        if level >= LEVEL_MAX:
            return None
        # the largest reconstruction index: the trellis may pick a grid point beyond the nearest level
        if fits(level + 2 if dependent else level, step, dtype):
            return qp
        if qp <= QP_MIN:
            return None
        qp -= 1


def _column_choices(arr: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> tuple[bool, bool]:
    """(column model, column prediction) for a quantized tensor of ``shape``."""
    if len(shape) < 2 or arr.size < PREDICT_TEST_MIN_ELEMENTS or shape[0] < 2:
        return True, True
    matrix = arr.reshape(shape[0], -1)
    count = min(PREDICT_SAMPLE_ROWS, shape[0] - 1)
    sampled = 1 + (np.arange(count) * (shape[0] - 1)) // count  # evenly spaced rows r >= 1
    rows, above = (_as_float_for_quantizer(matrix[r], dtype).reshape(count, -1) for r in (sampled, sampled - 1))
    share, row_spread, col_spread = _planning_kernels.row_statistics(rows, above, PREDICT_MARGIN)
    if share >= PREDICT_MIN_SHARE:
        return True, True
    return row_spread <= NO_COLUMNS_MIN_RATIO * col_spread, False


def _as_float_for_quantizer(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """A float32/float64 view or copy the quantizer kernels accept."""
    flat = arr.reshape(-1)
    if dtype == DType.BFLOAT16:
        out = np.empty(flat.shape[0], dtype=np.float32)
        _planning_kernels.bfloat16_to_float32(np.ascontiguousarray(flat), out)
        return out
    if dtype == DType.FLOAT16:
        return flat.astype(np.float32)
    return flat
