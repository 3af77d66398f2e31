"""The series' kernels against the NumPy expressions they replace, bit for bit: the same
operations in the same order on every element, on random tensors with zeros, negative zeros,
infinities, NaNs and extremes among them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepcabac_py.quant import portable
from deepcabac_py.series import _series_kernels as k

EPS, FLOOR = 1e-8, 1 / 16


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same bits, but for the sign and payload of a NaN (which operand's NaN an addition keeps
    is the compiler's choice: IEEE 754 leaves it open)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))) and a[~nan].tobytes() == b[~nan].tobytes()


SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -1e-30, 1e300, 5e-324]


def arrays(dtype, n: int, seed: int, special: bool = True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-30, 10, n))
    if special and n:
        at = rng.integers(0, n, max(1, n // 8))
        x[at] = rng.choice(SPECIAL, at.size)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def update_scale(v):
    return np.sqrt(np.abs(v.astype(np.float64))) + EPS


def residual_scale(v, mean):
    return np.maximum(np.sqrt(np.abs(v.astype(np.float64)) / mean), FLOOR)


CASES = st.tuples(st.sampled_from([np.float32, np.float64]), st.sampled_from([np.float32, np.float64]),
                  st.integers(0, 300), st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None)
@given(CASES, st.floats(1e-3, 1e3), st.floats(-2, 2))
def test_the_kernels_are_the_numpy_expressions(case, r, c):
    dm, dv, n, seed = case
    m, v, u = arrays(dm, n, seed), arrays(dv, n, seed + 1), arrays(dm, n, seed + 2)
    d, now, before = (arrays(np.float64, n, seed + j) for j in (3, 4, 5))
    mean = float(np.mean(np.abs(v.astype(np.float64)))) if n else 1.0
    with np.errstate(all="ignore"):
        out = np.empty(n)
        k.direction_into(m, v, EPS, out)
        assert same(out, m.astype(np.float64) / update_scale(v))

        out = np.empty(n, dtype=dm)
        k.from_update_into(u, r, v, EPS, out)
        assert same(out, (u.astype(np.float64) * r * update_scale(v)).astype(dm))

        out = np.empty(n, dtype=dm)
        k.times_into(u, r, out)
        assert same(out, (u.astype(np.float64) * r).astype(dm))

        out = np.empty(n, dtype=dm)
        finite = k.divided_into(d, r, out)
        assert same(out, (d / r).astype(dm)) and finite == bool(np.all(np.isfinite(d / r)))

        out = np.empty(n)
        k.rest_into(d, now, before, c, 1 - c, out)
        assert same(out, d - (c * now + (1 - c) * before))

        out = np.empty(n, dtype=dm)
        k.scaled_by_moment_into(d, v, mean, FLOOR, out)
        assert same(out, (d * residual_scale(v, mean)).astype(dm))

        pm, pv = arrays(dm, n, seed + 6), arrays(dv, n, seed + 7)
        for scaled in (False, True):
            for predicted in (False, True):
                for adam in (False, True):
                    out = np.empty(n, dtype=dm)
                    k.residual_applied_into(d, u, v, mean, FLOOR, scaled, m, v, pm, pv, c, 1 - c, EPS, predicted,
                                            adam, out)
                    value = d + (u.astype(np.float64) / residual_scale(v, mean) if scaled else u.astype(np.float64))
                    if predicted:
                        m64, pm64 = m.astype(np.float64), pm.astype(np.float64)
                        now, before = (m64 / update_scale(v), pm64 / update_scale(pv)) if adam else (m64, pm64)
                        value += c * now + (1 - c) * before
                    assert same(out, value.astype(dm))

        out = np.empty(n, dtype=dm)
        k.ratio_applied_into(m, u, out)
        assert same(out, (m * portable.exp2(u.astype(np.float64))).astype(dm))

        out = np.empty(n, dtype=dm)
        finite = k.difference_into(m, u, out)
        delta = m.astype(np.float64) - u.astype(np.float64)
        assert same(out, delta.astype(dm)) and finite == bool(np.all(np.isfinite(delta)))

        out = np.empty(n)
        k.bias_corrected_step_into(m, v, 0.3, 0.02, EPS, out)
        assert same(out, (m.astype(np.float64) / 0.3) / (np.sqrt(np.abs(v.astype(np.float64)) / 0.02) + EPS))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([np.float32, np.float64]), st.integers(0, 300), st.integers(0, 2**32 - 1), st.booleans())
def test_log_ratios_are_the_numpy_expression(dtype, n, seed, special):
    """log2(x / b), 0 where both are 0, defined only where both are finite and not negative and
    either is 0 only where the other is (else ``out`` is not read)."""
    rng = np.random.default_rng(seed)
    x, b = (np.abs(arrays(dtype, n, seed + j, special)) for j in (0, 1))
    if n:  # (zeros of the parent with zeros beside them, or only some, or zeros where it has none)
        at = rng.integers(0, n, max(1, n // 10))
        b[at] = 0
        case = rng.integers(0, 3)
        x[at if case != 1 else at[: len(at) * 3 // 4]] = 0
        if case == 2:
            x[rng.integers(0, n)] = 0
        if special and rng.random() < 0.3:
            x[rng.integers(0, n)] = -1
    out = np.empty(n, dtype=dtype)
    ok = k.log_ratio_into(x, b, out)
    xd, bd = x.astype(np.float64), b.astype(np.float64)
    defined = (not np.any((bd == 0) != (xd == 0)) and bool(np.all(np.isfinite(xd)))
               and bool(np.all(np.isfinite(bd))) and (not n or (xd.min() >= 0 and bd.min() >= 0)))
    if defined:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(xd == 0, 1.0, xd) / np.where(bd == 0, 1.0, bd)
            log_ratio = np.where(bd == 0, 0.0, portable.log2(ratio))
        defined = bool(np.all(np.isfinite(log_ratio)))
    assert ok == defined
    if defined:
        assert same(out, log_ratio.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nan_scale_stays_nan(dtype):
    out = np.empty(2, dtype=dtype)
    k.scaled_by_moment_into(np.ones(2), np.array([np.nan, 0.0], dtype=dtype), 1.0, FLOOR, out)
    assert np.isnan(out[0]) and out[1] == FLOOR
