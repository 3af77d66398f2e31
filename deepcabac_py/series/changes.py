"""A residual entry's tensors as their changes from the parent's: a weight's difference (in its
second moment's scale where the writer chose that), a second moment's log2 ratio; and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CorruptStreamError
from ..io.checkpoint import Checkpoint, numpy_to_tensor, tensor_to_numpy
from ..model.optimizer_state import SECOND_MOMENT, roles
from . import _series_kernels as _k
from . import arrays, moments

# A residual entry's second moment is coded as log2 of its ratio to the parent's, a float centred on
# 0 quantized like a weight, at this many qp below ``moments_qp`` (the log domain of a key codes
# levels counted from the smallest magnitude: about 3 bits per element for ratios near 1 where
# their log costs 1.5)
LOG_RATIO_SUFFIX = "~log2ratio"
LOG_RATIO_QP_OFFSET = -4


# What a tensor of a residual entry is to its parent's (:func:`applied`): a difference, a ratio (written
# before log2 ratios were) or the log2 of a ratio
RESIDUAL, RATIO, LOG_RATIO = "residual", "ratio", "log2 ratio"


# A predicted residual is coded in units that follow its weight's second moment v, which estimates
# the loss's curvature along the weight (Adam's v is the mean squared gradient: a Fisher estimate):
# times sqrt(v / mean v), so that where v is small a weight is rounded more coarsely, at most
# RESIDUAL_SCALE_FLOOR times the step. The loss grows by about what one step for all would add (the
# sum of v times the squared error is the same), for fewer bits. bench_series.py, one run each: the
# char-LSTM series 8.0% smaller at the same fidelity; the digits CNN's 1.0% smaller, its smallest
# next-step cosine 0.9962 -> 0.9931 (Adam divides the next step by sqrt(v), so the weights where v
# is small weigh more in it than in the loss).
# (:func:`._series_kernels.residual_scale`)
RESIDUAL_SCALE_FLOOR = 1 / 16


def residual_checkpoint(ckpt: Checkpoint, parent: Checkpoint) -> tuple[Checkpoint, list[str], list[str]]:
    """``ckpt`` with every weight-like float tensor replaced by its difference from ``parent``, and
    every second moment by log2 of its ratio to ``parent``'s (under its name with
    ``LOG_RATIO_SUFFIX``) where that is defined: the parent nonzero wherever the moment is, and
    neither negative. Returns it, the names of the residuals and of the log ratios."""
    tensors, residuals, log_ratios = {}, [], []
    kinds = roles(ckpt.tensors, ckpt.skeleton)
    for name, t in ckpt.tensors.items():
        arr, dtype, is_torch = tensor_to_numpy(t)
        if dtype in ("float32", "float64") and kinds.get(name) == SECOND_MOMENT and arr.size:
            base, base_dtype, _ = tensor_to_numpy(parent.tensors[name])
            log_ratio = np.empty(arr.size, dtype=dtype)
            if base.shape == arr.shape and _k.log_ratio_into(arrays.flat(arr, dtype), arrays.flat(base, base_dtype),
                                                             log_ratio):
                tensors[name + LOG_RATIO_SUFFIX] = numpy_to_tensor(log_ratio.reshape(arr.shape), dtype, is_torch)
                log_ratios.append(name)
                continue
        if dtype in arrays.FLOATS and name not in kinds and arr.size:
            base, base_dtype, _ = tensor_to_numpy(parent.tensors[name])
            # (float32 holds any difference of half-precision values; float64 stays float64)
            out_dtype = "float64" if dtype == "float64" else "float32"
            delta = np.empty(arr.size, dtype=out_dtype)
            if _k.difference_into(arrays.flat(arr, dtype), arrays.flat(base, base_dtype), delta):
                tensors[name] = numpy_to_tensor(delta.reshape(arr.shape), out_dtype, is_torch)
                residuals.append(name)
                continue
        tensors[name] = t
    return arrays.with_tensors(ckpt, tensors), residuals, log_ratios


def applied(where: str, name: str, change: Any, parent: Any, kind: str,
            guess: tuple[moments.Moments, moments.Moments, tuple[float, float]] | None = None,
            scale: tuple[np.ndarray, str, float] | None = None) -> Any:
    """The tensor ``name`` of an entry from its parent's and its decoded change: a ``RESIDUAL``
    (divided by its second moment's scale if ``scale``, (that moment, its dtype, its mean), is
    given: see :func:`._series_kernels.residual_scale`; then added, with its prediction if
    ``guess`` is given: :func:`.predictions.prediction_moments` and the coefficients), a ``RATIO``
    (multiplied; written before log2 ratios were) or a ``LOG_RATIO``."""
    if parent is None:
        raise CorruptStreamError(f"{where}: residual {name!r} has no parent tensor")
    base, dtype, is_torch = tensor_to_numpy(parent)
    delta, delta_dtype, _ = tensor_to_numpy(change)
    if delta.shape != base.shape:
        raise CorruptStreamError(f"{where}: residual {name!r} does not match its parent")
    if kind == RATIO:
        value = base * delta.astype(np.float64)
        return numpy_to_tensor(arrays.to_carrier(value, dtype), dtype, is_torch)
    out = arrays.output(base.size, dtype)
    if kind == LOG_RATIO:
        _k.ratio_applied_into(arrays.flat(base, dtype), arrays.flat(delta, delta_dtype), out)
    else:
        # (the kernel takes arrays for what it does not read: ``out`` stands in)
        second, mean = (arrays.flat(scale[0], scale[1]), scale[2]) if scale is not None else (out, 1.0)
        (m, mv, _), (pm, pv, _), (c0, c1) = guess if guess is not None else ((out, None, ()), (out, None, ()),
                                                                             (0.0, 0.0))
        adam = mv is not None and pv is not None
        mv, pv = (mv, pv) if mv is not None and pv is not None else (out, out)
        if any(a.size != base.size for a in (second, m, pm, mv, pv)):
            raise CorruptStreamError(f"{where}: the moments of {name!r} do not match it")
        _k.residual_applied_into(arrays.flat(base, dtype), arrays.flat(delta, delta_dtype), second, mean,
                                 RESIDUAL_SCALE_FLOOR, scale is not None, m, mv, pm, pv, c0, c1, moments.ADAM_EPS,
                                 guess is not None, adam, out)
    return numpy_to_tensor(arrays.carrier(out, dtype).reshape(base.shape), dtype, is_torch)


def from_log_ratios(where: str, tensors: dict[str, Any], names: list[str], parent: Checkpoint,
                    restored: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The decoded tensors with each second moment coded as a log2 ratio back as itself, in its
    place (those of ``restored`` as they are there)."""
    if not names:
        return dict(tensors)
    restored = restored or {}
    coded = {n + LOG_RATIO_SUFFIX: n for n in names}

    def back(k: str, t: Any) -> Any:
        name = coded[k]
        return restored[name] if name in restored else applied(where, name, t, parent.tensors.get(name), LOG_RATIO)

    return {coded.get(k, k): back(k, t) if k in coded else t for k, t in tensors.items()}
