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

Where Numba finds no writable place for its cache (a read-only install, an unwritable home), the
kernels are cached in a temporary directory for this process instead, with one warning.
"""

import os
import tempfile
import warnings

import numba

from .errors import DeepCabacWarning


def _cached(**options):
    def decorate(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as exc:  # "cannot cache function ...: no locator available"
            if "cannot cache" not in str(exc) or numba.config.CACHE_DIR:
                raise
            numba.config.CACHE_DIR = tempfile.mkdtemp(prefix="deepcabac-numba-")
            warnings.warn(f"no writable Numba cache beside the package or in the home directory: kernels are "
                          f"cached in {numba.config.CACHE_DIR} for this run (set NUMBA_CACHE_DIR to keep them)",
                          DeepCabacWarning, stacklevel=3)
            return numba.njit(cache=True, **options)(fn)

    return decorate


kernel = _cached(nogil=True)
inline = _cached(inline="always")
parallel_kernel = _cached(parallel=True, nogil=True)


def not_yet_compiled(*kernels) -> bool:
    """Whether any of these kernels has nothing in Numba's cache yet, so that its first call will
    compile it (seconds, not milliseconds): what a command line tells its user before it waits."""
    for k in kernels:
        try:
            index = k._cache._cache_file._index_path  # (Numba's cache layout: private, so guarded)
        except AttributeError:
            return False
        if not k.signatures and not os.path.exists(index):
            return True
    return False
