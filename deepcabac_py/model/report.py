"""Per-tensor and per-model compression figures: sizes, bits per parameter, ratios and errors."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..io.dtypes import FLOAT_NAMES as _FLOATS
from ..io.dtypes import bfloat16_to_float32
from .container import StreamHeader

if TYPE_CHECKING:  # checkpoint imports torch; header-only reports must not
    from ..io.checkpoint import Checkpoint


@dataclass
class TensorReport:
    name: str
    shape: list[int]
    dtype: str
    mode: str  # the coding mode's name; "+LP" when the levels go through the linear prediction,
    # "+TZ" when float chunks code their trailing zeros (low-bit modes 2, 3 and 5: bits 0, 2 and 5 of a
    # FLOAT entry's coder parameter), "+BF16" when float32 chunks hold bfloat16 values (mode 6, bit 6)
    qp: int | None
    step: float | None
    params: int
    bytes: int
    bits_per_param: float | None
    ratio_vs_fp32: float | None
    snr_db: float | None = None  # None: no original to compare with; inf: exact
    max_abs_error: float | None = None
    alias_of: str | None = None


@dataclass
class ModelReport:
    stream_bytes: int
    header_bytes: int
    params: int
    bits_per_param: float | None
    ratio_vs_fp32: float | None
    original_bytes: int | None  # the tensors' bytes in their own dtypes
    ratio_vs_original: float | None
    snr_db: float | None
    max_abs_error: float | None
    tensors: list[TensorReport] = field(default_factory=list)
    fidelity: dict | None = None  # e.g. {"accuracy": ...} filled by callers that can run the model

    def to_dict(self) -> dict:
        out = asdict(self)
        for item in [out, *out["tensors"]]:
            snr = item.get("snr_db")
            item["exact"] = None if snr is None else snr == math.inf
        return _jsonable(out)


def _jsonable(obj):
    # JSON has no infinities: an exact tensor has snr_db null and "exact": true (see to_dict).
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj


def _as_float64(t, dtype: str) -> np.ndarray:
    from ..io.checkpoint import tensor_to_numpy  # (torch: only for reports with errors)

    arr, name, _ = tensor_to_numpy(t)
    if name == "bfloat16":
        return bfloat16_to_float32(arr).astype(np.float64).reshape(-1)
    return arr.astype(np.float64).reshape(-1)


def _errors(original, decoded, dtype: str) -> tuple[float, float]:
    if dtype not in _FLOATS:
        from ..io.checkpoint import tensor_to_numpy  # (torch: only for reports with errors)

        a, _, _ = tensor_to_numpy(original)
        b, _, _ = tensor_to_numpy(decoded)
        same = np.array_equal(a, b)
        return (math.inf, 0.0) if same else (-math.inf, math.nan)
    x = _as_float64(original, dtype)
    y = _as_float64(decoded, dtype)
    if x.size == 0:
        return math.inf, 0.0
    finite = np.isfinite(x) & np.isfinite(y)
    same_nonfinite = (np.array_equal(np.isnan(x), np.isnan(y))
                      and np.array_equal(x[~finite & ~np.isnan(x)], y[~finite & ~np.isnan(y)]))
    diff = x[finite] - y[finite]
    noise = float(np.dot(diff, diff))
    signal = float(np.dot(x[finite], x[finite]))
    max_err = float(np.max(np.abs(diff))) if diff.size else 0.0
    if not same_nonfinite:
        return -math.inf, math.nan
    if noise == 0.0:
        return math.inf, max_err
    if signal == 0.0:
        return -math.inf, max_err
    return 10.0 * math.log10(signal / noise), max_err


def build_report(header: StreamHeader, original: Checkpoint | None = None,
                 decoded: Checkpoint | None = None) -> ModelReport:
    """Figures for a stream; errors too when the original and decoded checkpoints are given."""
    tensors: list[TensorReport] = []
    total_params = 0
    original_bytes = 0
    signal = noise = 0.0
    worst = 0.0
    exact_all = True
    names = [e.name for e in header.tensors]
    for e in header.tensors:
        dtype = e.dtype.name.lower()
        params = e.numel
        rep = TensorReport(
            name=e.name, shape=list(e.shape), dtype=dtype,
            mode="ALIAS" if e.is_alias else e.mode.name + ("+LP" if e.is_linear else "")
            + ("+TZ" if e.codes_trailing_zeros else "") + ("+BF16" if e.codes_halves else ""),
            qp=e.qp if e.mode.has_step and not e.is_alias else None,
            step=e.step if not e.is_alias else None, params=params, bytes=e.size,
            bits_per_param=(8.0 * e.size / params) if params and not e.is_alias else None,
            ratio_vs_fp32=(4.0 * params / e.size) if e.size else None,
            alias_of=names[e.alias_of] if e.is_alias else None,
        )
        if not e.is_alias:
            total_params += params
            original_bytes += params * e.dtype.itemsize
        if original is not None and decoded is not None and not e.is_alias:
            o, d = original.tensors.get(e.name), decoded.tensors.get(e.name)
            if o is not None and d is not None:
                rep.snr_db, rep.max_abs_error = _errors(o, d, dtype)
                if dtype in _FLOATS:
                    x, y = _as_float64(o, dtype), _as_float64(d, dtype)
                    ok = np.isfinite(x) & np.isfinite(y)
                    signal += float(np.dot(x[ok], x[ok]))
                    noise += float(np.dot(x[ok] - y[ok], x[ok] - y[ok]))
                if rep.max_abs_error is not None and not math.isnan(rep.max_abs_error):
                    worst = max(worst, rep.max_abs_error)
                exact_all = exact_all and rep.snr_db == math.inf
        tensors.append(rep)
    stream = header.total_size
    have_errors = original is not None and decoded is not None
    if have_errors:
        model_snr = math.inf if noise == 0.0 else (10.0 * math.log10(signal / noise) if signal else -math.inf)
        if exact_all:
            model_snr = math.inf
    return ModelReport(
        stream_bytes=stream,
        header_bytes=header.header_size,
        params=total_params,
        bits_per_param=8.0 * stream / total_params if total_params else None,
        ratio_vs_fp32=4.0 * total_params / stream if stream else None,
        original_bytes=original_bytes,
        ratio_vs_original=original_bytes / stream if stream else None,
        snr_db=model_snr if have_errors else None,
        max_abs_error=worst if have_errors else None,
        tensors=tensors,
    )


# The modes in words (``internals``: the stream's own names, as ``info --json`` gives them).
_MODE_WORDS = {"DEPENDENT": "trellis", "UNIFORM": "uniform", "INTEGER": "lossless", "RAW": "exact",
               "FLOAT": "float-lossless", "MAGNITUDE": "lossless", "ALIAS": "tied", "LOG": "log"}
_MODE_LEGEND = {
    "trellis": "trellis = dependent quantization, 4 states (its effective step is about twice qp's)",
    "uniform": "uniform = one step, levels rounded to it",
    "lossless": "lossless = integers coded exactly",
    "exact": "exact = stored bit for bit",
    "float-lossless": "float-lossless = floats coded bit for bit (exponent by row class, rANS)",
    "tied": "tied = the storage of another tensor",
    "log": "log = optimizer moments, log2 of each magnitude in steps of qp's step (in octaves)",
    "+pred": "+pred = coded as residuals of a prediction across columns",
    "+tz": "+tz = float32/float64 chunks coding each element's trailing zeros (by its exponent, or in its symbol)",
    "+bf16": "+bf16 = float32 chunks holding bfloat16 values, coded as their upper halves",
}
_SUFFIX_WORDS = {"LP": "+pred", "TZ": "+tz", "BF16": "+bf16"}


def mode_words(mode: str) -> str:
    """A table entry's mode in words: ``DEPENDENT+LP`` -> ``trellis+pred``."""
    base, *rest = mode.split("+")
    return _MODE_WORDS.get(base, base.lower()) + "".join(_SUFFIX_WORDS.get(r, "") for r in rest)


def format_report(rep: ModelReport, *, per_tensor: bool = True, internals: bool = False) -> str:
    """A plain-text table of a :class:`ModelReport`, with what its modes and qps mean (``internals``:
    the stream's own mode names, no legend)."""
    def num(x, fmt):
        if x is None:
            return "-"
        if isinstance(x, float) and math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if isinstance(x, float) and math.isnan(x):
            return "nan"
        return format(x, fmt)

    lines = []
    if per_tensor:
        width = min(60, max([len(t.name) for t in rep.tensors] + [6]))
        modes = [t.mode if internals else mode_words(t.mode) for t in rep.tensors]
        mw = max([len(m) for m in modes] + [10])  # (the columns stay aligned: `info` cuts rows at one)
        lines.append(f"{'tensor':<{width}} {'shape':>16} {'dtype':>8} {'mode':>{mw}} {'qp':>4} "
                     f"{'params':>11} {'bytes':>11} {'bits/p':>7} {'x fp32':>8} {'SNR dB':>7} {'max err':>9}")
        for t, mode in zip(rep.tensors, modes):
            name = t.name if len(t.name) <= width else "..." + t.name[-(width - 3):]
            shape = "x".join(map(str, t.shape)) or "scalar"
            lines.append(
                f"{name:<{width}} {shape:>16} {t.dtype:>8} {mode:>{mw}} {num(t.qp, 'd'):>4} "
                f"{t.params:>11,} {t.bytes:>11,} {num(t.bits_per_param, '.3f'):>7} {num(t.ratio_vs_fp32, '.2f'):>8} "
                f"{num(t.snr_db, '.1f'):>7} {num(t.max_abs_error, '.2e'):>9}"
            )
        lines.append("")
        if not internals:
            used = {mode_words(t.mode) for t in rep.tensors}
            words = [text for key, text in _MODE_LEGEND.items()
                     if key in used or (key.startswith("+") and any(key in u for u in used))
                     or any(u.startswith(key + "+") for u in used)]
            if words:
                lines.append("modes: " + "; ".join(words) + ".")
            if len({t.qp for t in rep.tensors if t.qp is not None}) > 1:
                lines.append("qp per tensor: lower is a finer step. Biases and norms get --qp-1d; from the model's "
                             "structure, embedding tables get coarser steps and layers scaled by a BatchNorm their "
                             "own (--importance none: one qp).")
            lines.append("")

    def ratio(r):
        if not r:
            return "-"
        return f"{r:.2f}x smaller" if r >= 1 else f"{1 / r:.2f}x larger"

    if rep.original_bytes and ratio(rep.ratio_vs_original) != ratio(rep.ratio_vs_fp32):
        versus = (f"{ratio(rep.ratio_vs_original)} than the tensors in their own dtypes, "
                  f"{ratio(rep.ratio_vs_fp32)} than fp32")
    else:  # (all fp32, or near enough that the two agree: one ratio)
        versus = f"{ratio(rep.ratio_vs_fp32)} than the tensors in fp32"
    lines.append(f"total: {rep.params:,} params in {rep.stream_bytes:,} bytes (header {rep.header_bytes:,}): "
                 f"{num(rep.bits_per_param, '.3f')} bits/param, {versus}")
    if rep.snr_db is not None:
        snr = "exact (lossless)" if rep.snr_db == math.inf else f"SNR {num(rep.snr_db, '.2f')} dB"
        lines.append(f"fidelity: {snr}, max abs error {num(rep.max_abs_error, '.3e')}")
    if rep.fidelity:
        lines.append("model fidelity: " + ", ".join(f"{k} {v}" for k, v in rep.fidelity.items()))
    return "\n".join(lines)


def format_matrix_sizes(rows: list[dict]) -> str:
    """A plain-text table of per-tensor matrix-format sizes (rows from
    :func:`deepcabac_py.matrix.formats.stream_format_sizes`): bytes as dense fp32, CSR, CER, CSER and
    in the stream, with the entropy of the levels; a total line in bits per weight."""
    if not rows:
        return "formats: no quantized tensor with two or more dimensions"
    width = min(60, max([len(r["name"]) for r in rows] + [6]))
    cols = ("dense", "csr", "cer", "cser", "stream")
    lines = [f"{'tensor':<{width}} {'matrix':>12} {'H bits':>6} {'dense B':>11} {'CSR B':>11} {'CER B':>11} "
             f"{'CSER B':>11} {'stream B':>11} {'CER code':>8} {'CSER code':>9}"]
    totals = dict.fromkeys(cols, 0)
    weights = 0
    for r in rows:
        name = r["name"] if len(r["name"]) <= width else "..." + r["name"][-(width - 3):]
        shape = "x".join(map(str, r["matrix_shape"]))
        lines.append(f"{name:<{width}} {shape:>12} {r['entropy_bits']:>6.3f} {r['dense']:>11,} {r['csr']:>11,} "
                     f"{r['cer']:>11,} {r['cser']:>11,} {r['stream']:>11,} {r['cer_coding']:>8} {r['cser_coding']:>9}")
        for c in cols:
            totals[c] += r[c]
        weights += r["matrix_shape"][0] * r["matrix_shape"][1]
    bpw = "  ".join(f"{c} {8.0 * totals[c] / weights:.3f}" for c in cols) if weights else "-"
    lines.append(f"total bits/weight over {weights:,} weights: {bpw}")
    return "\n".join(lines)
