"""Numba kernels of a checkpoint series' arithmetic over whole tensors (private:
:mod:`.checkpoint_series` is the front).

Each is one pass doing what a few NumPy expressions did with a float64 temporary per operation,
with the same operations in the same order on each element (no fastmath: no fused multiply-add),
so the results are the same to the last bit; the reductions (means, dot products) stay NumPy's,
whose pairwise order the written coefficients depend on. The appends of a 29M-parameter GPT-2
spent about half their time in those expressions.
"""

from __future__ import annotations

import numpy as np

from .._jit import float_helper, float_kernel


@float_helper
def residual_scale(v, mean, floor):
    """What a weight's predicted residual is multiplied by before it is coded: max(sqrt(|v| /
    mean), floor) in float64 (a NaN stays NaN, as NumPy's maximum keeps it)."""
    s = np.sqrt(np.abs(np.float64(v)) / mean)
    return floor if s < floor else s


@float_helper
def direction(m, v, eps):
    """m / (sqrt(|v|) + eps) in float64: Adam's step direction."""
    return np.float64(m) / (np.sqrt(np.abs(np.float64(v))) + eps)


@float_kernel
def direction_into(m, v, eps, out):
    """out[i] = direction(m[i], v[i], eps)."""
    for i in range(m.shape[0]):
        out[i] = direction(m[i], v[i], eps)


@float_kernel
def from_update_into(u, r, v, eps, out):
    """out[i] = u[i] * r * (sqrt(|v[i]|) + eps), rounded once to ``out``'s dtype: a first moment
    from the update domain."""
    for i in range(u.shape[0]):
        out[i] = np.float64(u[i]) * r * (np.sqrt(np.abs(np.float64(v[i]))) + eps)


@float_kernel
def times_into(u, r, out):
    """out[i] = u[i] * r, rounded once to ``out``'s dtype (SGD's buffer from the update domain)."""
    for i in range(u.shape[0]):
        out[i] = np.float64(u[i]) * r


@float_kernel
def divided_into(u, r, out):
    """out[i] = u[i] / r rounded to ``out``'s dtype; whether every quotient is finite (before the
    rounding)."""
    finite = True
    for i in range(u.shape[0]):
        q = u[i] / r
        if not np.isfinite(q):
            finite = False
        out[i] = q
    return finite


@float_kernel
def rest_into(d, now, before, c0, c1, out):
    """out[i] = d[i] - (c0 * now[i] + c1 * before[i]): a weight's change less its prediction."""
    for i in range(d.shape[0]):
        out[i] = d[i] - (c0 * now[i] + c1 * before[i])


@float_kernel
def scaled_by_moment_into(x, v, mean, floor, out):
    """out[i] = x[i] * residual_scale(v[i], mean, floor), rounded to ``out``'s dtype: a residual in
    its second moment's scale."""
    for i in range(x.shape[0]):
        out[i] = x[i] * residual_scale(v[i], mean, floor)


@float_kernel
def residual_applied_into(base, delta, v, mean, floor, scaled, m, mv, pm, pv, c0, c1, eps, predicted, adam, out):
    """out[i] = base[i] + delta[i] / scale + (c0 * now + c1 * before) in float64, rounded once to
    ``out``'s dtype: a weight from its parent and its decoded residual. ``scale`` is
    residual_scale(v[i], mean, floor) where ``scaled``, else 1; the prediction is added where
    ``predicted``: ``now`` and ``before`` the step directions of the entry's first moment ``m``
    and the parent's ``pm``, divided by their second moments ``mv`` and ``pv`` where ``adam``
    (:func:`direction`), themselves otherwise (SGD's buffers)."""
    for i in range(base.shape[0]):
        factor = np.float64(delta[i])
        if scaled:
            factor = factor / residual_scale(v[i], mean, floor)
        value = np.float64(base[i]) + factor
        if predicted:
            if adam:
                now, before = direction(m[i], mv[i], eps), direction(pm[i], pv[i], eps)
            else:
                now, before = np.float64(m[i]), np.float64(pm[i])
            value += c0 * now + c1 * before
        out[i] = value


@float_kernel
def ratio_applied_into(base, delta, out):
    """out[i] = base[i] * 2 ** delta[i] in float64 (the C library's exp2, one element at a time, as
    :func:`deepcabac_py.quant.portable.exp2`), rounded once to ``out``'s dtype."""
    for i in range(base.shape[0]):
        out[i] = np.float64(base[i]) * np.exp2(np.float64(delta[i]))


@float_kernel
def log_ratio_into(x, b, out):
    """log2(x / b) in float64 (the C library's log2), 0 where both are 0; False (and ``out`` left
    partly written) where it is not defined: ``x`` or ``b`` negative or not finite, one of them 0
    where the other is not, or a ratio whose log2 is not finite."""
    for i in range(x.shape[0]):
        xi, bi = np.float64(x[i]), np.float64(b[i])
        if not (np.isfinite(xi) and np.isfinite(bi)) or xi < 0 or bi < 0 or (bi == 0) != (xi == 0):
            return False
        if bi == 0:
            out[i] = 0.0
            continue
        lr = np.log2(xi / bi)
        if not np.isfinite(lr):
            return False
        out[i] = lr
    return True


@float_kernel
def difference_into(a, b, out):
    """out[i] = a[i] - b[i] in float64, rounded to ``out``'s dtype; whether every difference is
    finite (before the rounding)."""
    finite = True
    for i in range(a.shape[0]):
        d = np.float64(a[i]) - np.float64(b[i])
        if not np.isfinite(d):
            finite = False
        out[i] = d
    return finite


@float_kernel
def bias_corrected_step_into(m, v, first, second, eps, out):
    """out[i] = (m[i] / first) / (sqrt(|v[i]| / second) + eps) in float64: Adam's step direction
    with its bias corrections."""
    for i in range(m.shape[0]):
        out[i] = (np.float64(m[i]) / first) / (np.sqrt(np.abs(np.float64(v[i])) / second) + eps)
