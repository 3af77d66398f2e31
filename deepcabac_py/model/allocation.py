"""Bit allocation across tensors from their importance.

With importance ``F`` the expected loss of fidelity of a tensor quantized with step ``d`` grows as
``mean(F) * d**2`` while its rate falls by one bit per weight per halving of ``d``; the marginal
loss per bit is equal across tensors when ``mean(F) * d**2`` is the same for all of them.
``encode_model`` allocates this way whenever it has an importance (given, or structural).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..quant.steps import QP_MAX, QP_MIN, step_from_qp

# A tensor's step moves at most this many octaves away from the reference step: the importance of a
# tensor seen through a few calibration batches is an estimate, and a tensor the batches barely
# touch must not lose all its bits.
MAX_OCTAVES = 3
# step ~ mean(importance) ** -ALLOCATION_EXPONENT. 1/2 is the high-rate optimum; with importance
# from a few calibration batches and at the rates that matter, a milder exponent measured better
# (docs/design-notes.md).
ALLOCATION_EXPONENT = 0.35


def allocate_qps(importance: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], qp: int, *,
                 qp_density: int = 2, qp_1d: int | None = None,
                 reference: float | None = None) -> dict[str, int]:
    """A qp per tensor of ``importance`` such that ``mean importance * step**2`` is equal across
    tensors (equal marginal loss of fidelity per bit).

    ``qp`` is the step of a tensor of reference importance: ``2**reference`` if given, else the
    geometric mean, weighted by size, of the tensors with two or more dimensions. Steps stay within
    ``MAX_OCTAVES`` octaves of ``qp`` and, if ``qp_1d`` is given, no finer than it; a tensor whose
    importance is zero everywhere gets the coarsest of them.
    """
    step_from_qp(qp, qp_density)
    means: dict[str, float] = {}
    unused: list[str] = []  # importance 0 throughout: nothing the importance saw depends on it
    for name, imp in importance.items():
        arr = np.asarray(imp)  # (no float64 copy: importance may be a broadcast view)
        if arr.size and np.isfinite(float(arr.min())) and np.isfinite(float(arr.max())):
            m = float(arr.mean(dtype=np.float64))
            if m > 0.0:
                means[name] = m
            elif m == 0.0:
                unused.append(name)
    ref_names = [n for n in means if len(shapes.get(n, ())) >= 2] or list(means)
    if not ref_names:
        return {}
    if reference is not None:
        ref = float(reference)
    else:
        sizes = np.array([float(np.prod(shapes.get(n, np.shape(importance[n])))) for n in ref_names])
        logs = np.array([math.log2(means[n]) for n in ref_names])
        ref = float(np.sum(sizes * logs) / np.sum(sizes))
    per_octave = 1 << qp_density
    out = {}
    for name, m in means.items():
        octaves = ALLOCATION_EXPONENT * (math.log2(m) - ref)  # 4x as important: half the step
        octaves = min(MAX_OCTAVES, max(-MAX_OCTAVES, octaves))
        t_qp = qp - int(round(octaves * per_octave))
        if qp_1d is not None:
            t_qp = max(t_qp, qp_1d)
        out[name] = max(QP_MIN, min(QP_MAX, t_qp))
    for name in unused:  # (e.g. a pooler the task never reads): the coarsest step the cap allows
        out[name] = max(QP_MIN, min(QP_MAX, qp + MAX_OCTAVES * per_octave))
    return out
