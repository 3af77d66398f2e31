"""The quantization step of ``(qp, qp_density)``, as in NNC.

With k = 2**qp_density, ``step = (k + qp mod k) * 2**(floor(qp / k) - qp_density)``: a lower qp
is a finer step (more bytes, less error); every 2**qp_density steps of qp halve or double it. The
formula is NNC's exactly, so a setting here compares one to one with NNCodec. The step has at
most seven significant bits, so ``level * step`` is exact in float64 for every 31-bit level.
"""

from __future__ import annotations

import math

import numpy as np

from ..entropy.levelcoder import LEVEL_MAX

QP_MIN, QP_MAX = -(1 << 12), (1 << 12) - 1
QP_DENSITY_MAX = 6
_STEP_MIN = 2.0**-1022  # smallest normal float64


def check_qp(qp, qp_density) -> tuple[int, int]:
    """``(qp, qp_density)`` as ints; TypeError or ValueError (naming the range) otherwise."""
    if isinstance(qp, bool) or not isinstance(qp, (int, np.integer)):
        raise TypeError(f"qp must be an integer, got {type(qp).__name__}")
    if isinstance(qp_density, bool) or not isinstance(qp_density, (int, np.integer)):
        raise TypeError(f"qp_density must be an integer, got {type(qp_density).__name__}")
    qp, qp_density = int(qp), int(qp_density)
    if not QP_MIN <= qp <= QP_MAX:
        raise ValueError(f"qp must lie in [{QP_MIN}, {QP_MAX}], got {qp}")
    if not 0 <= qp_density <= QP_DENSITY_MAX:
        raise ValueError(f"qp_density must lie in [0, {QP_DENSITY_MAX}], got {qp_density}")
    return qp, qp_density


def step_from_qp(qp: int, qp_density: int = 2) -> float:
    """The quantization step of ``qp`` at ``qp_density`` (NNC's formula; exact in float64).

    Parameters
    ----------
    qp : int
        Quantization parameter in ``[QP_MIN, QP_MAX]``; lower is finer.
    qp_density : int
        Steps per octave are ``2**qp_density`` (0 to ``QP_DENSITY_MAX``).

    Returns
    -------
    float
        The step. ValueError if it would leave the normal float64 range.
    """
    qp, qp_density = check_qp(qp, qp_density)
    k = 1 << qp_density
    mul = k + (qp & (k - 1))
    shift = qp >> qp_density
    try:
        step = math.ldexp(float(mul), shift - qp_density)
    except OverflowError:
        step = math.inf
    # At the ends of the qp range with a small qp_density the step leaves float64 (0, subnormal or
    # infinite): such a qp cannot be used (it would divide by zero or overflow downstream).
    if not _STEP_MIN <= step < math.inf:
        raise ValueError(f"qp {qp} at qp_density {qp_density} gives a step outside the normal float64 range")
    return step


def qp_for_range(max_abs: float, qp: int, qp_density: int = 2) -> int:
    """The smallest qp >= ``qp`` whose levels for values up to ``max_abs`` fit the level coder."""
    qp, qp_density = check_qp(qp, qp_density)
    while max_abs / step_from_qp(qp, qp_density) + 0.5 >= LEVEL_MAX:
        if qp >= QP_MAX:
            raise ValueError(f"values up to {max_abs:g} cannot be quantized to 31-bit levels")
        # Jump a whole octave at a time while far away, then single steps. (In logarithms: the
        # ratio itself overflows to infinity for tiny steps.)
        octaves = math.log2(max_abs) - math.log2(step_from_qp(qp, qp_density)) - math.log2(LEVEL_MAX)
        qp = min(QP_MAX, qp + max(1, int(max(octaves, 0.0)) << qp_density))
    return qp


def qp_at_most(step: float, qp_density: int = 2) -> int:
    """The largest qp whose NNC step (at ``qp_density``) is not larger than ``step``."""
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not (0.0 < float(step) < math.inf):
        raise ValueError(f"step must be a positive finite number, got {step!r}")
    k = 1 << qp_density
    # step(qp) = (1 + (qp mod k) / k) * 2**floor(qp / k): log2(step) lies in [qp / k, qp / k + 1).
    qp = max(QP_MIN, min(QP_MAX, int(math.floor(k * math.log2(float(step))))))

    def step_of(q: int) -> float:
        try:
            return step_from_qp(q, qp_density)
        except ValueError:  # outside the normal float64 range: 0 below, infinity above
            return 0.0 if q < 0 else math.inf

    while qp < QP_MAX and step_of(qp + 1) <= step:
        qp += 1
    while step_of(qp) > step:
        if qp == QP_MIN:
            raise ValueError(f"step {step!r} is smaller than any step at qp_density {qp_density}")
        qp -= 1
    if step_of(qp) == 0.0:
        raise ValueError(f"step {step!r} is smaller than any step at qp_density {qp_density}")
    return qp


def qp_range(qp_density: int) -> tuple[int, int]:
    """The qps whose step is a normal float64 at ``qp_density``: at density 0 they are fewer than the
    format's qp field holds (one octave per qp)."""
    qp_density = check_qp(0, qp_density)[1]
    lo, hi = QP_MIN, QP_MAX
    while not _usable(lo, qp_density):
        lo += 1
    while not _usable(hi, qp_density):
        hi -= 1
    return lo, hi


def _usable(qp: int, qp_density: int) -> bool:
    try:
        step_from_qp(qp, qp_density)
    except ValueError:
        return False
    return True
