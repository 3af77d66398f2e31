"""Numba settings in one place.

Every kernel is compiled with ``cache=True`` (the CLI and the tests must not pay compilation twice)
and ``nogil=True`` (independent substreams run on threads). ``fastmath`` is never used: the bytes
depend on exact integer arithmetic. ``inline='always'`` is reserved for helpers that take scalars
only; arrays passed to small helpers are reference-counted on every call, which costs more than the
arithmetic coding itself.

``parallel_kernel`` is for the few kernels that split independent rows across threads with
``numba.prange`` (the entropy-bounded matrix formats). Launching a parallel region costs a few
microseconds, so callers keep a serial path (a plain ``kernel``) for small inputs.
"""

import numba

kernel = numba.njit(cache=True, nogil=True)
scalar_helper = numba.njit(cache=True, inline="always")
# Helpers that take arrays and run once per weight inside a kernel's loop: inlined at the IR level,
# so no call (and no reference counting of the arrays) remains.
inline_helper = numba.njit(cache=True, inline="always")
parallel_kernel = numba.njit(parallel=True, cache=True, nogil=True)
