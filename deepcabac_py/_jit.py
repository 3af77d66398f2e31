"""Numba settings in one place.

Every kernel is compiled with ``cache=True`` (the CLI and the tests must not pay compilation twice)
and ``nogil=True`` (independent substreams run on threads). ``fastmath`` is never used: the bytes
depend on exact integer arithmetic.

``inline`` is for the small helpers a kernel calls once per weight: they are inlined at the IR
level, so no call remains, and in particular no reference counting of array arguments, which costs
more than the arithmetic coding itself.

``parallel_kernel`` is for the few kernels that split independent rows across threads with
``numba.prange`` (the entropy-bounded matrix formats). Launching a parallel region costs a few
microseconds, so callers keep a serial path (a plain ``kernel``) for small inputs.
"""

import numba

kernel = numba.njit(cache=True, nogil=True)
inline = numba.njit(cache=True, inline="always")
parallel_kernel = numba.njit(parallel=True, cache=True, nogil=True)
