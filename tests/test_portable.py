"""The processor-independent log2, exp2 and dot product (deepcabac_py.quant.portable): the C
library's results bit for bit, as Python's math module gives them on every processor."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepcabac_py.quant import portable


def test_log2_and_exp2_are_the_c_librarys_bit_for_bit():
    rng = np.random.default_rng(3)
    x = np.concatenate([np.exp2(rng.uniform(-1070, 1020, 4000)), rng.uniform(1e-3, 1e3, 4000),
                        [1.0, 2.0, 0.5, np.finfo(np.float64).tiny, np.finfo(np.float64).max, 5e-324]])
    got = portable.log2(x.reshape(2, -1))
    assert got.shape == (2, x.size // 2)
    assert got.reshape(-1).tobytes() == np.array([math.log2(v) for v in x]).tobytes()
    e = np.concatenate([rng.uniform(-1070, 1020, 4000), rng.integers(-40, 40, 100) / 8.0, [0.0, -1074.0, 1023.5]])
    if not hasattr(math, "exp2"):
        pytest.skip("math.exp2 (the C library's) needs Python 3.11")
    assert portable.exp2(e).tobytes() == np.array([math.exp2(v) for v in e]).tobytes()


def test_log2_and_exp2_keep_zero_and_infinities():
    out = portable.log2(np.array([0.0, np.inf]))
    assert out[0] == -np.inf and out[1] == np.inf
    out = portable.exp2(np.array([-np.inf, np.inf, -1100.0, 1100.0]))
    assert out.tolist() == [0.0, np.inf, 0.0, np.inf]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6)), min_size=0, max_size=300))
def test_dot_sums_the_rounded_products_pairwise(pairs):
    a = np.array([p[0] for p in pairs], dtype=np.float64)
    b = np.array([p[1] for p in pairs], dtype=np.float64)
    got = portable.dot(a, b)
    assert got == float(np.add.reduce(a * b))
    assert math.isclose(got, math.fsum((a * b).tolist()), rel_tol=1e-9, abs_tol=1e-3)
