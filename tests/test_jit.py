"""The package's own compiled helpers (deepcabac_py._jit) against plain Python."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from deepcabac_py._jit import copy_bytes, load_le64, trailing_zeros


@numba.njit
def _compiled_load(array, byte):
    return load_le64(array, byte)


@numba.njit
def _compiled_copy(dst, dst_byte, src, src_byte, nbytes):
    copy_bytes(dst, dst_byte, src, src_byte, nbytes)


@numba.njit
def _compiled_trailing_zeros(x):
    return trailing_zeros(x)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=8, max_size=64), st.data(), st.sampled_from([np.uint8, np.uint32]))
def test_an_unaligned_load_is_the_eight_bytes_little_endian(raw, data, dtype):
    raw = raw[:len(raw) // np.dtype(dtype).itemsize * np.dtype(dtype).itemsize]
    array = np.frombuffer(raw, dtype=dtype).copy()
    byte = data.draw(st.integers(0, len(raw) - 8))
    assert int(_compiled_load(array, byte)) == int.from_bytes(raw[byte:byte + 8], "little")


@settings(deadline=None)  # (its first example compiles the helper)
@given(st.integers(1, 2**64 - 1))
def test_trailing_zeros_counts_the_low_zero_bits(x):
    expected = (x & -x).bit_length() - 1
    assert _compiled_trailing_zeros(np.uint64(x)) == expected


def _refused_under_bounds_checks(tmp_path, setup: str, bad_calls: str) -> None:
    """Run ``setup`` (it defines ``f``), then ``f(*bad)`` for each of ``bad_calls`` (a Python tuple
    expression) in a process with NUMBA_BOUNDSCHECK=1: each call must raise IndexError."""
    code = (setup + f"for bad in {bad_calls}:\n"
            "    try:\n"
            "        f(*bad)\n"
            "    except IndexError:\n"
            "        continue\n"
            "    raise SystemExit(f'f{bad[1:]} went through')\n")
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr + run.stdout


def test_an_unaligned_load_past_the_end_is_refused_under_bounds_checks(tmp_path):
    # the fuzz targets run with NUMBA_BOUNDSCHECK=1: there the load must check its bytes as an
    # array index would
    _refused_under_bounds_checks(tmp_path, "import numba, numpy as np\n"
                                           "from deepcabac_py._jit import load_le64\n"
                                           "f = numba.njit(lambda a, i: load_le64(a, i))\n"
                                           "a = np.arange(4, dtype=np.uint32)\n"
                                           "assert int(f(a, 8)) == 2 | 3 << 32\n",
                                 "((a, 9), (a, 12), (a, -1))")


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=80), st.binary(min_size=0, max_size=80), st.data(),
       st.sampled_from([np.uint8, np.uint16, np.uint32]))
def test_a_byte_copy_moves_exactly_the_bytes_asked_for(src_raw, dst_raw, data, dtype):
    size = np.dtype(dtype).itemsize
    src = np.frombuffer(src_raw[:len(src_raw) // size * size], dtype=dtype).copy()
    dst = np.frombuffer(dst_raw[:len(dst_raw) // size * size], dtype=dtype).copy()
    src_bytes, dst_bytes = src.tobytes(), dst.tobytes()
    nbytes = data.draw(st.integers(0, min(len(src_bytes), len(dst_bytes))))
    src_byte = data.draw(st.integers(0, len(src_bytes) - nbytes))
    dst_byte = data.draw(st.integers(0, len(dst_bytes) - nbytes))
    expected = dst_bytes[:dst_byte] + src_bytes[src_byte:src_byte + nbytes] + dst_bytes[dst_byte + nbytes:]
    # (inlined into a kernel, and called as it is; the offsets and the count of any integer type)
    for copy, as_int in ((_compiled_copy, int), (copy_bytes, np.int32), (copy_bytes, np.uint64)):
        out = dst.copy()
        copy(out, as_int(dst_byte), src, as_int(src_byte), as_int(nbytes))
        assert out.tobytes() == expected
        assert src.tobytes() == src_bytes


def test_a_byte_copy_outside_its_arrays_is_refused_under_bounds_checks(tmp_path):
    _refused_under_bounds_checks(tmp_path, "import numba, numpy as np\n"
                                           "from deepcabac_py._jit import copy_bytes\n"
                                           "f = numba.njit(lambda d, i, s, j, n: copy_bytes(d, i, s, j, n))\n"
                                           "d = np.zeros(4, dtype=np.uint32)\n"
                                           "s = np.arange(8, dtype=np.uint8)\n"
                                           "f(d, 8, s, 0, 8)\n"
                                           "assert d[2] == 0x03020100 and d[3] == 0x07060504 and d[0] == 0\n",
                                 "((d, 9, s, 0, 8), (d, 0, s, 1, 8), (d, -1, s, 0, 1), (d, 0, s, -1, 1), "
                                 "(d, 0, s, 0, -1), (d, 16, s, 0, 1))")
