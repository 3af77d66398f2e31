"""Whole-model encoding and decoding: policy, parallel substreams and the container.

``encode_model`` flattens any mapping of tensors (nested checkpoints included), decides per tensor how
to code it (quantized floats, lossless integers, raw bytes), cuts every coded tensor into independent
chunks and encodes the chunks on a thread pool (the kernels release the GIL). ``decode_model`` is its
inverse and returns the original structure.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import levelcoder, linear_prediction, quantize
from ._jit import kernel
from .checkpoint import Checkpoint, flatten, is_plain, numpy_to_tensor, plain_skeleton, tensor_to_numpy, unflatten
from .container import (
    FLAG_ALIAS,
    FLAG_TORCH,
    Coder,
    DType,
    Mode,
    StreamHeader,
    TensorEntry,
    raw_chunk_elements,
    read_header,
    write_header,
)
from .errors import CheckpointError, CorruptStreamError, LimitExceededError, TruncatedStreamError

DEFAULT_QP = -32
# Tensors with at most one dimension (biases, norms) are few but sensitive: by default their step is
# QP_1D_OCTAVES octaves finer than the weights'. On EfficientNet-Lite0 this keeps the KL of the
# outputs where NNC's fixed near-lossless qp -75 puts it, for 30% fewer bytes on those tensors
# (measured with benchmarks/bench_rd.py's harness). qp_1d=-75 gives NNC's setting.
QP_1D_OCTAVES = 6
DEFAULT_QP_DENSITY = 2
DEFAULT_QUANTIZER = "trellis"
# importance="structural" (the default): data-free importance from the model's own structure
# (embedding tables, BatchNorm statistics), see deepcabac_py/structure.py.
STRUCTURAL = "structural"
DEFAULT_IMPORTANCE = STRUCTURAL

_NUMPY_CARRIER = {
    DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16,
    DType.FLOAT64: np.float64, DType.INT8: np.int8, DType.INT16: np.int16, DType.INT32: np.int32,
    DType.INT64: np.int64, DType.UINT8: np.uint8, DType.UINT16: np.uint16, DType.UINT32: np.uint32,
    DType.UINT64: np.uint64, DType.BOOL: np.bool_, DType.COMPLEX64: np.complex64,
    DType.COMPLEX128: np.complex128,
}
_DTYPE_BY_NAME = {d.name.lower(): d for d in DType}

Progress = Callable[[int], None]


@dataclass
class QuantizedTensor:
    """The integer levels of one tensor and how to turn them back into values.

    For quantized floats ``values = levels * step`` (rounded once to ``dtype``); for integer tensors
    ``step`` is ``None`` and the levels are the values.
    """

    name: str
    levels: np.ndarray  # int32, the tensor's shape
    step: float | None
    dtype: str
    qp: int | None = None
    qp_density: int | None = None

    def dequantize(self) -> Any:
        """The values in the original dtype (a torch tensor for bfloat16, else a numpy array)."""
        dtype = _DTYPE_BY_NAME[self.dtype]
        if self.step is None:
            arr = self.levels.astype(_NUMPY_CARRIER[dtype])
            return arr
        arr = _reconstruct(self.levels, self.step, dtype)
        return numpy_to_tensor(arr, self.dtype, True) if dtype == DType.BFLOAT16 else arr


# --------------------------------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Importance:
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
        _relative_kernel(part, self.mean, IMPORTANCE_FLOOR, out)
        return out


@kernel
def _relative_kernel(part, mean, floor, out):
    # float32((x / mean + floor) / (1 + floor)) in float64, in one pass: as four numpy passes over
    # every chunk it cost 4% of a trellis encode of MiniLM.
    for i in range(part.shape[0]):
        out[i] = np.float32((np.float64(part[i]) / mean + floor) / (1.0 + floor))


@dataclass
class _Plan:
    entry: TensorEntry
    array: np.ndarray | None  # the values (numpy carrier), None for aliases
    layout: levelcoder.ChunkLayout | None = None
    quantizer: str = "nearest"
    lam: float = 0.0
    importance: _Importance | None = None  # per-weight importance, relative to its mean
    linear: linear_prediction.LinearPredictor | None = None  # codes residuals of this prediction
    levels: np.ndarray | None = None  # the whole tensor's levels (flat int32) when ``linear`` is set
    max_level: int = 0  # a bound on |level| of a quantized tensor


@dataclass(frozen=True)
class _Quantizer:
    """How float tensors are quantized: the method, its lambda and the per-weight importance."""

    method: str
    lambda_scale: float
    importance: Mapping[str, Any]
    structural: bool = False  # importance comes from the model's structure (resolved when planning)

    @property
    def lam(self) -> float:
        return quantize.DEFAULT_LAMBDA[self.method] * self.lambda_scale


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _lookup_qp(name: str, overrides: Mapping[str, int]) -> int | None:
    if name in overrides:
        return overrides[name]
    for pattern, value in overrides.items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return None


@kernel
def _float_range(values):
    # max |x| and whether all are finite, without temporaries the size of the tensor
    top = 0.0
    finite = True
    for i in range(values.shape[0]):
        x = np.float64(values[i])
        if x != x or x == np.inf or x == -np.inf:
            finite = False
        elif abs(x) > top:
            top = abs(x)
    return top, finite


@kernel
def _int_range(values):
    lo = np.int64(0)
    hi = np.int64(0)
    for i in range(values.shape[0]):
        x = np.int64(values[i])
        if x < lo:
            lo = x
        if x > hi:
            hi = x
    return lo, hi


# Column prediction (the level coder's switch to coding a row against the running mean of the rows
# above) pays where neighbouring rows look alike: position embeddings, the untrained rows of a word
# embedding. Elsewhere it never switches on and costs 1.8 ns per weight in both directions (8% of the
# coder's time on all-MiniLM-L6-v2). Large tensors get it only when at least this share of sampled
# rows is clearly closer to the row above than to zero (sum |x_r - x_(r-1)| < 7/8 sum |x_r|, the
# coder's own switching margin); on MiniLM the share is 0.98 for the position embeddings, 0.06 for
# the word embedding and 0 for every other matrix.
PREDICT_MIN_SHARE = 0.02
PREDICT_MARGIN = 0.875
PREDICT_SAMPLE_ROWS = 128
PREDICT_TEST_MIN_ELEMENTS = 1 << 16  # smaller tensors keep both: the test would cost what it saves
# The column model's scale is the mean of a row scale and a column scale. Where the rows' mean
# magnitudes spread much more than the columns' (standard deviations of their logs, on the sampled
# rows), the column scale only blurs the row's: then the model is off (2.5 ns per weight less). On
# MiniLM that is 11 of 37 matrices (3.8 M weights: most attention outputs and intermediate layers),
# 2,005 bytes fewer; on EfficientNet-Lite0 4 tensors, 0.03% fewer bytes.
NO_COLUMNS_MIN_RATIO = 1.5


@kernel
def _row_statistics(x, samples):
    """Over up to ``samples`` evenly spaced rows r >= 1: the share clearly closer to row r - 1 than to zero,
    and the standard deviations of log(mean |x|) of those rows and of the columns over them."""
    rows, ncols = x.shape
    count = min(samples, rows - 1)
    hits = 0
    row_mean = np.zeros(max(count, 1))
    col_mean = np.zeros(ncols)
    for k in range(count):
        r = 1 + (k * (rows - 1)) // count
        near = 0.0
        far = 0.0
        for c in range(ncols):
            a = np.float64(x[r, c])
            near += abs(a - np.float64(x[r - 1, c]))
            far += abs(a)
            col_mean[c] += abs(a)
        if near < PREDICT_MARGIN * far:
            hits += 1
        row_mean[k] = far / ncols
    total = 0.0
    for c in range(ncols):
        col_mean[c] /= max(count, 1)
        total += col_mean[c]
    floor = 1e-6 * total / ncols + 1e-300  # all-zero rows or columns count, without a log of zero
    return hits / max(count, 1), _log_spread(row_mean[:count], floor), _log_spread(col_mean, floor)


@kernel
def _log_spread(values, floor):
    n = values.shape[0]
    if n < 2:
        return 0.0
    mean = 0.0
    for v in values:
        mean += np.log(v + floor)
    mean /= n
    var = 0.0
    for v in values:
        d = np.log(v + floor) - mean
        var += d * d
    return np.sqrt(var / n)


def _column_choices(values: np.ndarray, shape: tuple[int, ...]) -> tuple[bool, bool]:
    """(column model, column prediction) for a quantized tensor of ``shape``."""
    if len(shape) < 2 or values.size < PREDICT_TEST_MIN_ELEMENTS or shape[0] < 2:
        return True, True
    share, row_spread, col_spread = _row_statistics(values.reshape(shape[0], -1), PREDICT_SAMPLE_ROWS)
    if share >= PREDICT_MIN_SHARE:
        return True, True
    return row_spread <= NO_COLUMNS_MIN_RATIO * col_spread, False


def _as_float_for_quantizer(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """A float32/float64 view or copy the quantizer kernels accept."""
    flat = arr.reshape(-1)
    if dtype == DType.BFLOAT16:
        return (flat.astype(np.uint32) << 16).view(np.float32)
    if dtype == DType.FLOAT16:
        return flat.astype(np.float32)
    return flat


def _plan_tensor(name: str, tensor, *, qp: int, qp_1d: int, qp_density: int, overrides, exact,
                 quantizer: _Quantizer) -> _Plan:
    arr, dtype_name, is_torch = tensor_to_numpy(tensor)
    dtype = _DTYPE_BY_NAME[dtype_name]
    entry = TensorEntry(name=name, dtype=dtype, shape=tuple(int(d) for d in arr.shape), mode=Mode.RAW,
                        flags=FLAG_TORCH if is_torch else 0)
    if arr.size == 0:
        return _Plan(entry, arr)
    if dtype.is_float and not exact(name):
        values = _as_float_for_quantizer(arr, dtype)
        top, finite = _float_range(values)
        if not finite:
            warnings.warn(f"{name}: contains NaN or infinity; stored exactly (raw)", stacklevel=3)
            return _Plan(entry, arr)
        chosen = _lookup_qp(name, overrides)
        if chosen is None:
            chosen = qp_1d if arr.ndim <= 1 else qp
        try:
            entry.qp = quantize.qp_for_range(float(top), chosen, qp_density)
        except ValueError:
            warnings.warn(f"{name}: values up to {top:g} do not fit 31-bit levels at any qp of density "
                          f"{qp_density}; stored exactly (raw)", stacklevel=3)
            return _Plan(entry, arr)
        entry.qp_density = qp_density
        dependent = quantizer.method == "trellis"
        entry.mode = Mode.DEPENDENT if dependent else Mode.UNIFORM
        entry.coder = Coder.ADAPTIVE_SCALE
        max_level = int(float(top) / quantize.step_from_qp(entry.qp, qp_density) + 0.5)
        if dependent:
            max_level = max_level // 2 + 1
        columns, predict = _column_choices(values, entry.shape)
        layout = levelcoder.layout_for_shape(entry.shape, max_abs_level=max_level, predict=predict, columns=columns)
        entry.chunk_elements = layout.chunk_elements
        entry.coder_param = layout.coder_param
        return _Plan(entry, arr, layout, quantizer.method, quantizer.lam,
                     _relative_importance(name, quantizer.importance.get(name), arr.shape), max_level=max_level)
    elif not dtype.is_float and dtype not in (DType.COMPLEX64, DType.COMPLEX128):
        if dtype in (DType.UINT64,) and int(arr.max()) > levelcoder.LEVEL_MAX:
            return _Plan(entry, arr)
        lo, hi = _int_range(arr.reshape(-1).view(np.uint8) if dtype == DType.BOOL else arr.reshape(-1))
        if lo < -levelcoder.LEVEL_MAX or hi > levelcoder.LEVEL_MAX:
            return _Plan(entry, arr)
        entry.mode, entry.coder = Mode.INTEGER, Coder.ADAPTIVE_SCALE
        max_level = max(-int(lo), int(hi))
    else:
        return _Plan(entry, arr)
    layout = levelcoder.layout_for_shape(entry.shape, max_abs_level=max_level)
    entry.chunk_elements = layout.chunk_elements
    entry.coder_param = layout.coder_param
    return _Plan(entry, arr, layout)


# Within a tensor, importance is smoothed towards its mean: (importance / mean + FLOOR) / (1 + FLOOR).
# A weight the calibration data never exercised (an embedding row of a token it did not contain)
# has zero measured importance, but other data will need it; and a diagonal Fisher from a few
# batches is noisy. Measured on EfficientNet-Lite0 and MiniLM (benchmarks/bench_rd.py): floors of
# 2-5 beat 0.1 and 0.5 clearly; most of the gain of importance comes from the allocation across
# tensors.
IMPORTANCE_FLOOR = 2.0


def _importance_array(importance) -> np.ndarray:
    # as given (no float64 copy: a broadcast view stays a view)
    if not isinstance(importance, np.ndarray) and hasattr(importance, "detach"):
        importance = importance.detach().cpu().numpy()
    imp = np.asarray(importance)
    if imp.dtype.kind not in "fiub":
        raise ValueError(f"importance must be numbers, got dtype {imp.dtype}")
    return imp


def _relative_importance(name: str, importance, shape: tuple[int, ...]) -> _Importance | None:
    if importance is None:
        return None
    imp = _importance_array(importance)
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
    return _Importance(imp, mean)


def _quantizer_inputs(plan: _Plan, start: int, stop: int):
    """The float values of a quantized chunk, its step, and its relative importance (or None)."""
    flat = plan.array.reshape(-1)[start:stop]
    # nearest rounding has no use for it: no pass over the chunk's importance then
    weighted = plan.importance is not None and plan.quantizer != "nearest"
    imp = plan.importance.chunk(start, stop) if weighted else None
    return (_as_float_for_quantizer(flat, plan.entry.dtype),
            quantize.step_from_qp(plan.entry.qp, plan.entry.qp_density), imp)


def _chunk_levels(plan: _Plan, start: int, stop: int) -> np.ndarray:
    entry = plan.entry
    if entry.mode.is_quantized:
        values, step, imp = _quantizer_inputs(plan, start, stop)
        if plan.quantizer == "nearest":
            return quantize.quantize_nearest(values, step)
        layout = plan.layout
        return quantize.quantize_rd(values, step, method=plan.quantizer, lam=plan.lam, ncols=layout.ncols,
                                    col0=layout.first_column(start), k_offset=layout.k_offset,
                                    predict=layout.predict, importance=imp)
    flat = plan.array.reshape(-1)[start:stop]
    if entry.dtype == DType.BOOL:
        return flat.view(np.uint8).astype(np.int32)
    return flat.astype(np.int32)


def _with_linear_prediction(plan: _Plan) -> _Plan:
    """The plan with a linear prediction across columns where one qualifies and pays. Nearest
    rounding and RDOQ (its levels are chosen by the plain coder's rates, then coded either way);
    not the trellis, which codes each block as it chooses it."""
    e, layout = plan.entry, plan.layout
    if (layout is None or plan.linear is not None or e.mode != Mode.UNIFORM
            or plan.quantizer not in ("nearest", "rdoq") or len(e.shape) < 2):
        return plan
    ncols = levelcoder.row_length(e.shape)
    if not linear_prediction.qualifies(e.numel // max(ncols, 1), ncols) or layout.chunk_elements % ncols:
        return plan
    if plan.quantizer == "nearest":  # rounding does not depend on the chunks: one pass
        levels = _chunk_levels(plan, 0, e.numel)
    else:  # chunk by chunk, exactly as they would be coded without the prediction
        levels = _plan_levels(plan).levels.reshape(-1)
    with linear_prediction.blas_threads(True):
        predictor = linear_prediction.fit(levels, ncols, level_bound=plan.max_level)
    if predictor is None:
        return plan
    linear = levelcoder.ChunkLayout(layout.numel, 0, layout.chunk_elements, layout.k_offset, linear=True)
    entry = dataclasses.replace(e, coder_param=linear.coder_param)
    return dataclasses.replace(plan, entry=entry, layout=linear, linear=predictor, levels=levels)


def _encode_chunk(plan: _Plan, k: int, start: int, stop: int) -> tuple[bytes, np.ndarray]:
    """A chunk's substream and its levels (the reconstruction indices of trellis chunks)."""
    if plan.linear is not None:
        levels = plan.levels[start:stop]
        return levelcoder.encode_chunk(plan.linear.residuals(levels), plan.layout, k), levels
    if plan.entry.mode.is_quantized and plan.quantizer == "trellis":
        # one pass: the trellis codes each block as it commits it
        values, step, imp = _quantizer_inputs(plan, start, stop)
        levels = np.empty(stop - start, dtype=np.int32)
        data = quantize.trellis_encode_chunk(values, step, lam=plan.lam, layout=plan.layout, index=k,
                                             importance=imp, levels=levels)
        return data, levels
    levels = _chunk_levels(plan, start, stop)
    return levelcoder.encode_chunk(levels, plan.layout, k), levels


def _values_from_levels(e: TensorEntry, levels: np.ndarray) -> np.ndarray:
    """Values of one chunk's decoded levels (trellis levels are still the transmitted ones)."""
    if e.mode == Mode.DEPENDENT:
        levels = quantize.dq_indices(levels)
    if e.mode.is_quantized:
        return _reconstruct(levels, e.step, e.dtype)
    if e.dtype == DType.BOOL:
        if levels.size and (int(levels.min()) < 0 or int(levels.max()) > 1):
            raise CorruptStreamError(f"tensor {e.name!r}: a decoded boolean is neither 0 nor 1")
        return levels != 0
    info = np.iinfo(_NUMPY_CARRIER[e.dtype])
    if levels.size and (int(levels.min()) < info.min or int(levels.max()) > info.max):
        raise CorruptStreamError(f"tensor {e.name!r}: a decoded integer is out of its dtype's range")
    return levels


def _reconstruct(levels: np.ndarray, step: float, dtype: DType) -> np.ndarray:
    if dtype == DType.BFLOAT16:
        return quantize.reconstruct_bf16_bits(levels, step)
    return quantize.reconstruct(levels, step, _NUMPY_CARRIER[dtype])


# --------------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------------


def _resolve_threads(threads: int | None) -> int:
    if threads is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    return threads


def _exact_predicate(keep_exact) -> Callable[[str], bool]:
    if keep_exact is True:
        return lambda name: True
    if not keep_exact:
        return lambda name: False
    if isinstance(keep_exact, str):
        keep_exact = [keep_exact]
    patterns = list(keep_exact)
    return lambda name: _matches(name, patterns)


def _make_quantizer(quantizer: str, lambda_scale: float, importance) -> _Quantizer:
    if quantizer not in quantize.QUANTIZERS:
        raise ValueError(f"quantizer must be one of {', '.join(quantize.QUANTIZERS)}, got {quantizer!r}")
    if isinstance(lambda_scale, bool) or not isinstance(lambda_scale, (int, float)) or not (
            0.0 <= float(lambda_scale) < float("inf")):
        raise ValueError(f"lambda_scale must be a finite number >= 0, got {lambda_scale!r}")
    if isinstance(importance, str):
        if importance != STRUCTURAL:
            raise ValueError(f"importance must be a mapping, {STRUCTURAL!r} or None, got {importance!r}")
        return _Quantizer(quantizer, float(lambda_scale), {}, structural=True)
    if importance is not None and not isinstance(importance, Mapping):
        raise TypeError("importance must map tensor names to arrays of their shape (or numbers)")
    return _Quantizer(quantizer, float(lambda_scale), dict(importance or {}))


def resolve_qp_1d(qp: int, qp_1d: int | None, qp_density: int) -> int:
    """The qp of tensors with at most one dimension: ``qp_1d``, or QP_1D_OCTAVES finer than ``qp``."""
    if qp_1d is not None:
        return qp_1d
    return max(quantize.QP_MIN, quantize._check_qp(qp, qp_density)[0] - (QP_1D_OCTAVES << qp_density))


def _floor_variance_steps(ckpt: Checkpoint, overrides: dict[str, int], user: Mapping[str, int], qp_1d: int,
                          qp_density: int) -> None:
    """Keep every BatchNorm running variance above the eps it is added to from decoding to 0 (the
    channel's scale would jump by sqrt(var / eps)): the step of a ``*.running_var`` tensor stays at
    most a quarter of its smallest such variance, unless the user set its qp. (Allocation can give
    these tensors coarse steps: EfficientNet-Lite0 at qp -24 had 124 variances above 1e-3 at 0.)"""
    from .structure import BN_EPS

    for name, t in ckpt.tensors.items():
        if not name.endswith(".running_var") or _lookup_qp(name, user) is not None:
            continue
        arr, dtype_name, _ = tensor_to_numpy(t)
        if arr.ndim != 1 or dtype_name not in ("float32", "float64"):
            continue
        above = arr[np.isfinite(arr) & (arr > BN_EPS)]
        if not above.size:
            continue
        bound = float(above.min()) / 4.0
        chosen = _lookup_qp(name, overrides)
        chosen = qp_1d if chosen is None else chosen
        while chosen > quantize.QP_MIN and quantize.step_from_qp(chosen, qp_density) > bound:
            chosen -= 1
        overrides[name] = chosen


def _plan_model(model, qp, qp_1d, qp_density, qp_overrides, keep_exact,
                quantizer: _Quantizer) -> tuple[Checkpoint, list[_Plan], int, Callable[[str, Any], _Plan]]:
    """The checkpoint, a plan per tensor (and alias), the resolved qp_1d, and how a tensor would be
    planned with the same resolved settings (steps, importance)."""
    ckpt = model if isinstance(model, Checkpoint) else flatten(model)
    qp_1d = resolve_qp_1d(qp, qp_1d, qp_density)
    reference = None
    if quantizer.structural:
        from .structure import structural_importance

        # importance 1 (a dense layer without BN) is the reference that gets qp itself
        quantizer = _Quantizer(quantizer.method, quantizer.lambda_scale, structural_importance(ckpt))
        reference = 0.0
    unknown = sorted(set(quantizer.importance) - set(ckpt.tensors))
    if unknown:
        raise ValueError(f"importance names tensors the model does not have: {', '.join(unknown[:5])}")
    for value in (qp, qp_1d):
        quantize.step_from_qp(value, qp_density)  # validates both
    overrides = dict(qp_overrides or {})
    for key, value in overrides.items():
        quantize.step_from_qp(value, qp_density)
    if quantizer.importance:
        # Importance also allocates the bits across tensors; explicit overrides still win.
        from .rd import allocate_qps

        shapes = {name: tuple(int(d) for d in t.shape) for name, t in ckpt.tensors.items()}
        allocated = allocate_qps({n: _importance_array(v) for n, v in quantizer.importance.items()}, shapes,
                                 qp, qp_density=qp_density, qp_1d=qp_1d, reference=reference)
        overrides = {**{n: q for n, q in allocated.items() if _lookup_qp(n, overrides) is None}, **overrides}
    _floor_variance_steps(ckpt, overrides, qp_overrides or {}, qp_1d, qp_density)
    exact = _exact_predicate(keep_exact)

    def plan_one(name: str, t) -> _Plan:
        return _plan_tensor(name, t, qp=qp, qp_1d=qp_1d, qp_density=qp_density, overrides=overrides, exact=exact,
                            quantizer=quantizer)

    plans = [plan_one(name, t) for name, t in ckpt.tensors.items()]
    index = {p.entry.name: i for i, p in enumerate(plans)}
    for alias, target in ckpt.aliases.items():
        base = plans[index[target]].entry
        plans.append(_Plan(TensorEntry(name=alias, dtype=base.dtype, shape=base.shape, mode=base.mode,
                                       coder=Coder.NONE, flags=FLAG_ALIAS | (base.flags & FLAG_TORCH),
                                       alias_of=index[target]), None))
    return ckpt, plans, qp_1d, plan_one


@dataclass
class _Shift:
    """A layer's expected output shift (from its quantization error), taken out by another tensor:
    ``target += factor * shift`` (:func:`deepcabac_py.structure.shift_absorbers`)."""

    layer: str
    mean_in: np.ndarray
    target: str
    factor: Any  # a number or one per channel


def _plan(model, qp, qp_1d, qp_density, qp_overrides, keep_exact, quantizer: _Quantizer, batchnorm_eps,
          correct_shifts: bool = False) -> tuple[Checkpoint, list[_Plan], int, Callable[[str, Any], _Plan], list[_Shift]]:
    """:func:`_plan_model`, with the BatchNorm statistics coded coarsely
    (:func:`~deepcabac_py.batchnorm.statistics_qps`) and their layers' ``weight`` and ``bias``
    compensating exactly (:mod:`deepcabac_py.batchnorm`) when ``batchnorm_eps`` is given; and, if
    ``correct_shifts``, the layers whose mean output shift a later tensor takes out."""
    from . import batchnorm

    eps = batchnorm.check_eps(batchnorm_eps)
    ckpt = model if isinstance(model, Checkpoint) else flatten(model)
    absorbers = {}
    if correct_shifts:
        from .structure import shift_absorbers

        absorbers = shift_absorbers(ckpt)  # (from the statistics as given, before any compensation)
    planned, plans, qp_1d, plan_one, eps_modules = _plan_batchnorm(ckpt, qp, qp_1d, qp_density, qp_overrides,
                                                                   keep_exact, quantizer, eps)
    return planned, plans, qp_1d, plan_one, _shifts(ckpt, plans, absorbers, eps_modules)


def _shifts(ckpt: Checkpoint, plans: list[_Plan], absorbers: Mapping[str, tuple[np.ndarray, str]],
            eps_modules: Mapping[str, float]) -> list[_Shift]:
    """The shifts to take out, where both the layer and the absorbing tensor are quantized (a tensor
    kept exact stays exact) and the absorbing tensor is float32 or float64 (``ckpt``: the model as
    given, before any BatchNorm compensation)."""
    by_name = {p.entry.name: p for p in plans}

    def quantized(name: str) -> bool:
        p = by_name.get(name)
        return p is not None and p.layout is not None and p.entry.mode.is_quantized

    out = []
    for layer, (mean_in, target) in absorbers.items():
        factor: Any = -1.0 if target.endswith(".bias") else 1.0
        module = target.rsplit(".", 1)[0]
        if target.endswith(".running_mean") and module in eps_modules:
            # the statistics are coded coarsely and weight and bias compensate: the bias takes it,
            # scaled as the BN scales its input
            arrays = {s: tensor_to_numpy(ckpt.tensors[f"{module}.{s}"])[0].astype(np.float64)
                      for s in ("weight", "running_var")}
            factor = -arrays["weight"] / np.sqrt(np.maximum(arrays["running_var"], 0.0) + eps_modules[module])
            target = f"{module}.bias"
        if quantized(layer) and quantized(target) and by_name[target].array.dtype in (np.float32, np.float64):
            out.append(_Shift(layer, mean_in, target, factor))
    return out


def _take_out_shifts(plans: list[_Plan], shifts: list[_Shift], plan_one: Callable[[str, Any], _Plan],
                     ckpt: Checkpoint, decoded: Callable[[str], np.ndarray]) -> list[_Plan]:
    """``plans`` with every shift's target planned again from its values plus ``factor * shift``,
    the shift measured on the layer's ``decoded`` values (float64, the tensor's shape)."""
    from .structure import output_shift

    index = {p.entry.name: i for i, p in enumerate(plans)}
    totals: dict[str, np.ndarray] = {}
    for sh in shifts:
        layer = plans[index[sh.layer]]
        delta = sh.factor * output_shift(layer.array, decoded(sh.layer), sh.mean_in)
        totals[sh.target] = totals.get(sh.target, 0.0) + delta
    out = list(plans)
    for target, delta in totals.items():
        plan = plans[index[target]]
        values = plan.array.astype(np.float64) + delta
        if not np.all(np.isfinite(values)):
            continue
        _, dtype_name, is_torch = tensor_to_numpy(ckpt.tensors[target])
        out[index[target]] = plan_one(target, numpy_to_tensor(values.astype(plan.array.dtype), dtype_name, is_torch))
    return out


def _plan_batchnorm(ckpt: Checkpoint, qp, qp_1d, qp_density, qp_overrides, keep_exact, quantizer: _Quantizer,
                    eps) -> tuple[Checkpoint, list[_Plan], int, Callable[[str, Any], _Plan], dict[str, float]]:
    """:func:`_plan_model` with the BatchNorm treatment of ``batchnorm_eps`` (see :func:`_plan`),
    and the eps of every BN it applied to."""
    from . import batchnorm

    if eps is None:
        return (*_plan_model(ckpt, qp, qp_1d, qp_density, qp_overrides, keep_exact, quantizer), {})
    arrays, kinds = {}, {}  # the 1-D float tensors a BatchNorm layer may own, and (dtype, is_torch)
    for name, t in ckpt.tensors.items():
        if name.rsplit(".", 1)[-1] in batchnorm.TENSORS:
            a, dtype, is_torch = tensor_to_numpy(t)
            if dtype in ("float32", "float64") and a.ndim == 1:
                arrays[name], kinds[name] = a, (dtype, is_torch)
    found = batchnorm.groups(arrays)
    modules = [m for m in found if batchnorm.eps_of(m, eps) is not None]
    if isinstance(eps, Mapping):
        unknown = sorted(set(eps) - set(found))
        if unknown:
            raise ValueError(f"batchnorm_eps names no BatchNorm layer of the model: {', '.join(unknown[:5])}")
    user = dict(qp_overrides or {})
    overrides = dict(user)
    for m in modules:
        qps = batchnorm.statistics_qps(arrays[f"{m}.running_mean"], arrays[f"{m}.running_var"],
                                       batchnorm.eps_of(m, eps), qp, qp_density)
        for stat, stat_qp in zip(batchnorm.STATISTICS, qps):
            if _lookup_qp(f"{m}.{stat}", user) is None:
                overrides[f"{m}.{stat}"] = stat_qp
    ckpt, plans, qp_1d, plan_one = _plan_model(ckpt, qp, qp_1d, qp_density, overrides, keep_exact, quantizer)
    # The statistics exactly as the stream will carry them ...
    by_name = {p.entry.name: p for p in plans}
    coded = {}
    for m in modules:
        stats = [by_name.get(f"{m}.{stat}") for stat in batchnorm.STATISTICS]
        # (weight and bias may be kept exact: then the layer's function is kept to float rounding)
        if all(p is not None and p.layout is not None and p.entry.mode.is_quantized for p in stats):
            coded[m] = [np.asarray(_plan_levels(p).dequantize(), dtype=np.float64) for p in stats]
    if not coded:
        return ckpt, plans, qp_1d, plan_one, {}
    # ... and weight and bias made up for them, planned with the settings every other tensor got
    # (so nothing else changes, not even the steps that importance allocated).
    tensors = dict(ckpt.tensors)
    for m, (mean_c, var_c) in coded.items():
        new = batchnorm.compensate(arrays[f"{m}.weight"], arrays[f"{m}.bias"], arrays[f"{m}.running_mean"],
                                   arrays[f"{m}.running_var"], mean_c, var_c, batchnorm.eps_of(m, eps))
        if new is None:
            raise CheckpointError(f"BatchNorm {m}: running_var must be finite and > -eps to code its statistics"
                                  " coarsely (leave the layer out of batchnorm_eps)")
        for suffix, value in zip(("weight", "bias"), new):
            name = f"{m}.{suffix}"
            dtype, is_torch = kinds[name]
            tensors[name] = numpy_to_tensor(value.astype(dtype), dtype, is_torch)
            by_name[name] = plan_one(name, tensors[name])
    ckpt = dataclasses.replace(ckpt, tensors=tensors)
    return (ckpt, [by_name[p.entry.name] if p.array is not None else p for p in plans], qp_1d, plan_one,
            {m: batchnorm.eps_of(m, eps) for m in coded})


def _plan_levels(plan: _Plan) -> QuantizedTensor:
    """A planned tensor's levels, chunk by chunk as the encoder quantizes them (the RD quantizers
    and the trellis state restart with every substream)."""
    return _assembled(plan.entry, [_chunk_levels(plan, *plan.layout.bounds(k)) for k in range(plan.layout.count)])


def _assembled(e: TensorEntry, parts: list[np.ndarray]) -> QuantizedTensor:
    """A tensor from the levels of its chunks as the encoder makes them (the trellis's transmitted
    levels become reconstruction indices chunk by chunk: its state restarts with every substream)."""
    if e.mode == Mode.DEPENDENT:
        parts = [quantize.dq_indices(part) for part in parts]
    levels = np.concatenate(parts) if len(parts) != 1 else parts[0]
    return _quantized(e, levels.reshape(e.shape))


def _decoded64(q: QuantizedTensor) -> np.ndarray:
    """The decoded values of a quantized tensor in float64 (for the bias correction's sums)."""
    return q.levels.astype(np.float64) * q.step


def encode_model(
    model: Mapping[str, Any] | Checkpoint,
    *,
    qp: int = DEFAULT_QP,
    qp_density: int = DEFAULT_QP_DENSITY,
    qp_1d: int | None = None,
    qp_overrides: Mapping[str, int] | None = None,
    keep_exact: bool | str | Iterable[str] = False,
    quantizer: str = DEFAULT_QUANTIZER,
    lambda_scale: float = 1.0,
    importance: Mapping[str, Any] | str | None = DEFAULT_IMPORTANCE,
    batchnorm_eps: float | Mapping[str, float] | None = None,
    bias_correction: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
) -> bytes:
    """Compress a model (a state dict, any nested mapping of tensors, or a :class:`Checkpoint`).

    Float tensors are quantized with the step of ``qp`` (``qp_1d`` for tensors with at most one
    dimension: biases, norms; by default six octaves finer than ``qp``); ``qp_overrides`` maps tensor names or glob patterns to their own qp.
    ``quantizer`` is ``"trellis"`` (dependent quantization, the default: fewest bytes at a given
    fidelity; its effective step is about twice the step of ``qp``, as in NNC), ``"rdoq"``
    (rate-distortion optimised rounding) or ``"nearest"`` (plain rounding); ``lambda_scale`` scales
    the rate-distortion trade-off of the first two. ``importance`` maps tensor names to non-negative
    per-weight importances of the tensor's shape (e.g. :func:`deepcabac_py.rd.diagonal_fisher`), or
    to one number for a whole tensor: errors cost more where it is high, and each tensor's step
    follows its mean importance (:func:`deepcabac_py.rd.allocate_qps`). The default,
    ``"structural"``, derives it from the model itself without data (embedding tables, BatchNorm
    statistics: :func:`deepcabac_py.structure.structural_importance`); ``None`` gives every weight
    the same importance and every tensor the step of ``qp``/``qp_1d``. ``keep_exact`` (``True`` or
    names/patterns) stores float tensors bit-exactly instead. Integer and boolean tensors are always lossless; non-tensor entries
    are kept. ``batchnorm_eps`` (the eps of the model's BatchNorm layers: one number, or module names
    to numbers; :func:`deepcabac_py.batchnorm.epsilons` reads them from a torch model) codes those
    layers' running statistics coarsely (about 1% of each layer's typical channel, never finer than
    ``qp``) and changes their ``weight`` and ``bias`` so that each layer computes the same function in
    eval mode (:mod:`deepcabac_py.batchnorm`). ``bias_correction`` takes the mean shift that each
    layer's quantization error causes out of the BatchNorm after it (its ``running_mean``; the
    ``bias`` where ``batchnorm_eps`` applies) or out of its own bias, as estimated without data from
    the BatchNorm before it (:func:`deepcabac_py.structure.shift_absorbers`); models without such
    layers are not affected. Under ``"nearest"`` and ``"rdoq"``, a tall matrix (16 rows per column or
    more, 48 to 4096 columns) whose columns are correlated, such as a word embedding, is coded as the
    residuals of a linear prediction across its columns (:mod:`deepcabac_py.linear_prediction`;
    same levels, fewer bytes).
    The output is deterministic for the same input and settings, whatever ``threads`` is.
    """
    threads = _resolve_threads(threads)
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be True or False, got {bias_correction!r}")
    ckpt, plans, qp_1d, plan_one, shifts = _plan(model, qp, qp_1d, qp_density, qp_overrides, keep_exact,
                                                 _make_quantizer(quantizer, lambda_scale, importance), batchnorm_eps,
                                                 bias_correction)
    # The layers first, then the tensors that take out their shifts (from the layers' levels).
    targets = {sh.target for sh in shifts}
    layers = {sh.layer for sh in shifts}
    chunk_levels: dict[tuple[str, int], np.ndarray] = {}

    def run(job: tuple[_Plan, int]) -> bytes:
        plan, k = job
        start, stop = plan.layout.bounds(k)
        data, levels = _encode_chunk(plan, k, start, stop)
        if plan.entry.name in layers:
            chunk_levels[plan.entry.name, k] = levels
        if progress is not None:
            progress(stop - start)
        return data

    def run_all(jobs: list[tuple[_Plan, int]]) -> dict[tuple[str, int], bytes]:
        # Largest chunks first keeps both cores busy to the end; results are put back in table order.
        jobs = sorted(jobs, key=lambda job: -job[0].layout.size(job[1]))
        keys = [(p.entry.name, k) for p, k in jobs]
        if threads == 1 or len(jobs) <= 1:
            return {key: run(job) for key, job in zip(keys, jobs)}
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return dict(zip(keys, pool.map(run, jobs)))

    def chunk_jobs(names_in: bool) -> list[tuple[_Plan, int]]:
        return [(p, k) for p in plans if p.layout is not None and (p.entry.name in targets) == names_in
                for k in range(p.layout.count)]

    def run_phase(names_in: bool) -> dict[tuple[str, int], bytes]:
        # the phase's tensors get their linear predictions, then its chunks are coded
        nonlocal plans
        plans = [_with_linear_prediction(p) if (p.entry.name in targets) == names_in else p for p in plans]
        with linear_prediction.blas_threads(any(p.linear is not None for p in plans)):
            return run_all(chunk_jobs(names_in))

    results = run_phase(False)
    if shifts:
        by_name = {p.entry.name: p for p in plans}

        def decoded(name: str) -> np.ndarray:
            plan = by_name[name]
            return _decoded64(_assembled(plan.entry, [chunk_levels[name, k] for k in range(plan.layout.count)]))

        plans = _take_out_shifts(plans, shifts, plan_one, ckpt, decoded)
        results.update(run_phase(True))

    payload: list[bytes] = []
    offset = 0
    for plan in plans:
        e = plan.entry
        if e.flags & FLAG_ALIAS:
            continue
        if plan.layout is None:
            flat = plan.array.reshape(-1).astype(plan.array.dtype.newbyteorder("<"), copy=False)
            e.chunk_elements = raw_chunk_elements(e.dtype)
            chunks = [flat[k:k + e.chunk_elements].tobytes() for k in range(0, flat.size, e.chunk_elements)]
            if progress is not None:
                progress(plan.array.size)
        else:
            chunks = [results[e.name, k] for k in range(plan.layout.count)]
            if plan.linear is not None:
                chunks.insert(0, plan.linear.to_bytes())
        e.chunk_sizes = [len(c) for c in chunks]
        e.size = sum(e.chunk_sizes)
        e.offset = offset
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        e.crc32 = crc
        offset += e.size
        payload.extend(chunks)

    # A plain flat state dict needs no skeleton: the decoder rebuilds it from the tensor table.
    metadata = {"kind": ckpt.kind}
    if not is_plain(ckpt, allow_ordered=False):
        metadata["skeleton"] = ckpt.skeleton
    if ckpt.metadata is not None:
        metadata["safetensors_metadata"] = ckpt.metadata
    header = write_header(qp, qp_1d, qp_density, metadata, [p.entry for p in plans])
    return b"".join([header, *payload])


def quantize_model(
    model: Mapping[str, Any] | Checkpoint,
    *,
    qp: int = DEFAULT_QP,
    qp_density: int = DEFAULT_QP_DENSITY,
    qp_1d: int | None = None,
    qp_overrides: Mapping[str, int] | None = None,
    keep_exact: bool | str | Iterable[str] = False,
    quantizer: str = DEFAULT_QUANTIZER,
    lambda_scale: float = 1.0,
    importance: Mapping[str, Any] | str | None = DEFAULT_IMPORTANCE,
    batchnorm_eps: float | Mapping[str, float] | None = None,
    bias_correction: bool = True,
) -> dict[str, QuantizedTensor]:
    """The levels and steps :func:`encode_model` would code, without entropy coding (same
    arguments). ``levels * step`` are the decoded values (for trellis tensors the levels are the
    reconstruction indices, not the transmitted ones).

    Tensors stored raw (kept exact, non-finite, complex) are left out.
    """
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be True or False, got {bias_correction!r}")
    ckpt, plans, _, plan_one, shifts = _plan(model, qp, qp_1d, qp_density, qp_overrides, keep_exact,
                                             _make_quantizer(quantizer, lambda_scale, importance), batchnorm_eps,
                                             bias_correction)
    out = {plan.entry.name: _plan_levels(plan) for plan in plans if plan.layout is not None}
    if shifts:
        plans = _take_out_shifts(plans, shifts, plan_one, ckpt, lambda name: _decoded64(out[name]))
        targets = {sh.target for sh in shifts}
        out.update({p.entry.name: _plan_levels(p) for p in plans if p.entry.name in targets})
    return out


def _quantized(e: TensorEntry, levels: np.ndarray) -> QuantizedTensor:
    uniform = e.mode.is_quantized
    return QuantizedTensor(e.name, levels, e.step, e.dtype.name.lower(),
                           e.qp if uniform else None, e.qp_density if uniform else None)


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------


def read_stream_header(data) -> StreamHeader:
    """Parse the header of a model stream (bytes-like) without decoding any payload."""
    return read_header(memoryview(data))


def _payload_views(data, header: StreamHeader, e: TensorEntry) -> list[memoryview]:
    base = header.header_size + e.offset
    view = memoryview(data)[base:base + e.size]
    if len(view) != e.size:
        raise TruncatedStreamError(f"tensor {e.name!r}: payload truncated")
    if zlib.crc32(view) != e.crc32:
        raise CorruptStreamError(f"tensor {e.name!r}: payload checksum mismatch (the stream is damaged)")
    views, pos = [], 0
    for size in e.chunk_sizes:
        views.append(view[pos:pos + size])
        pos += size
    return views


def _check_max_elements(header: StreamHeader, max_elements: int | None) -> None:
    """The header parser already bounds every tensor by its payload (docs/format.md §6.5); this is the
    caller's own, usually much smaller, bound on what one stream may make us allocate."""
    if max_elements is None:
        return
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 0:
        raise ValueError(f"max_elements must be a non-negative int or None, not {max_elements!r}")
    claimed = sum(e.numel for e in header.tensors if not e.is_alias)
    if claimed > max_elements:
        raise LimitExceededError(f"the stream holds {claimed:,} elements, more than max_elements={max_elements:,}")


def _decode_entries(data, header: StreamHeader, *, want_levels: bool, threads: int,
                    progress: Progress | None, max_elements: int | None = None) -> dict[str, np.ndarray]:
    """Decode every non-alias tensor: levels (int32) if ``want_levels`` else values (carrier dtype)."""
    _check_max_elements(header, max_elements)
    outputs: dict[str, np.ndarray] = {}
    jobs = []
    for e in header.tensors:
        if e.is_alias:
            continue
        carrier = _NUMPY_CARRIER[e.dtype]
        views = _payload_views(data, header, e)
        if e.mode == Mode.RAW:
            if want_levels:
                continue
            little = np.dtype(carrier).newbyteorder("<")
            parts = [np.frombuffer(v, dtype=little) for v in views]
            arr = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, little))
            outputs[e.name] = arr.astype(carrier).reshape(e.shape)
            continue
        layout = levelcoder.layout_from_stream(e.shape, e.chunk_elements, e.coder_param)
        predictor = None
        if e.is_linear:
            predictor = linear_prediction.from_bytes(views[0], levelcoder.row_length(e.shape))
            views = views[1:]
        out = np.empty(e.numel, dtype=np.int32 if want_levels else carrier)
        outputs[e.name] = out
        for k, view in enumerate(views):
            jobs.append((e, layout, k, view, out, predictor))

    def levels_into(layout, k, view, predictor, window) -> None:
        if predictor is None:
            levelcoder.decode_chunk(view, layout, k, window)
            return
        residuals = np.empty_like(window)
        levelcoder.decode_chunk(view, layout, k, residuals)
        predictor.rebuild(residuals, window)

    def run(job) -> None:
        e, layout, k, view, out, predictor = job
        start, stop = layout.bounds(k)
        if want_levels:
            levels_into(layout, k, view, predictor, out[start:stop])
            if e.mode == Mode.DEPENDENT:
                out[start:stop] = quantize.dq_indices(out[start:stop])
        elif e.mode.is_quantized and e.dtype == DType.FLOAT32:
            # Levels and float32 values have the same size: decode into the output, convert in place.
            window = out[start:stop].view(np.int32)
            levels_into(layout, k, view, predictor, window)
            if e.mode == Mode.DEPENDENT:
                quantize.dq_reconstruct_f32_inplace(window, e.step)
            else:
                quantize.reconstruct_f32_inplace(window, e.step)
        else:
            levels = np.empty(stop - start, dtype=np.int32)
            levels_into(layout, k, view, predictor, levels)
            out[start:stop] = _values_from_levels(e, levels)
        if progress is not None:
            progress(stop - start)

    order = sorted(jobs, key=lambda job: -job[1].size(job[2]))
    with linear_prediction.blas_threads(any(job[5] is not None for job in jobs)):
        if threads == 1 or len(order) <= 1:
            for job in order:
                run(job)
        else:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                list(pool.map(run, order))
    for e in header.tensors:
        if e.name in outputs:
            outputs[e.name] = outputs[e.name].reshape(e.shape)
    return outputs


def decode_checkpoint(data, *, threads: int | None = None, progress: Progress | None = None,
                      max_elements: int | None = None) -> Checkpoint:
    """Decode a model stream into a :class:`Checkpoint` (flat tensors plus the original structure).
    ``max_elements`` refuses (:class:`LimitExceededError`) a stream whose tensors hold more elements."""
    threads = _resolve_threads(threads)
    header = read_stream_header(data)
    values = _decode_entries(data, header, want_levels=False, threads=threads, progress=progress,
                             max_elements=max_elements)
    tensors, aliases = {}, {}
    for e in header.tensors:
        if e.is_alias:
            aliases[e.name] = header.tensors[e.alias_of].name
        else:
            tensors[e.name] = numpy_to_tensor(values[e.name], e.dtype.name.lower(), bool(e.flags & FLAG_TORCH))
    meta = header.metadata
    skeleton = meta.get("skeleton")
    if skeleton is None:
        skeleton = plain_skeleton(list(tensors))
    if not isinstance(skeleton, dict):
        raise CorruptStreamError("stream metadata holds a malformed model skeleton")
    kind = meta.get("kind", "mapping")
    st_meta = meta.get("safetensors_metadata")
    return Checkpoint(tensors=tensors, skeleton=skeleton, kind=kind if isinstance(kind, str) else "mapping",
                      metadata=st_meta if isinstance(st_meta, dict) else None, aliases=aliases)


def decode_model(data, *, threads: int | None = None, progress: Progress | None = None,
                 max_elements: int | None = None) -> Any:
    """Decode a stream made by :func:`encode_model` back into the structure that was encoded.

    Tensors come back as the type they were given in (torch tensors or numpy arrays), with their
    dtypes and shapes; quantized floats hold ``level * step`` rounded to their dtype. Memory is
    bounded by the payload (a header cannot claim more elements than its bytes can code); for
    untrusted input, ``max_elements`` sets a tighter bound of your own.
    """
    return unflatten(decode_checkpoint(data, threads=threads, progress=progress, max_elements=max_elements))


def decode_levels(data, *, threads: int | None = None, max_elements: int | None = None) -> dict[str, QuantizedTensor]:
    """The integer levels and steps of every level-coded tensor (for integer inference)."""
    threads = _resolve_threads(threads)
    header = read_stream_header(data)
    levels = _decode_entries(data, header, want_levels=True, threads=threads, progress=None,
                             max_elements=max_elements)
    return {e.name: _quantized(e, levels[e.name]) for e in header.tensors if e.name in levels}
