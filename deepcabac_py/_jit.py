"""Numba settings in one place.

Every kernel is compiled with ``cache=True`` (the CLI and the tests must not pay compilation twice)
and ``nogil=True`` (independent substreams run on threads). ``fastmath`` is never used: the bytes
depend on exact integer arithmetic.

``inline`` is for the small helpers over arrays that a kernel calls once per weight: they are
inlined at the IR level, so no call remains, and in particular no reference counting of array
arguments, which costs more than the arithmetic coding itself. It costs compilation: Numba types
and copies the helper at every call site, and nested helpers multiply.

``helper`` is for the other helpers, those of scalars above all (a bit length, a float's fields,
a context's number): ordinary functions, compiled once per signature, which LLVM inlines where
they are called. The tANS decoder's kernel, five specialised segment loops over the same helpers,
expanded 558 inlined calls and took 198 s to compile (the lossless golden stream, one process, an
empty cache); with its helpers of scalars and its one-word raw-bit reader as ``helper``, 63 s, and
it decodes as fast. Its other array readers stay ``inline``: as calls, EfficientNet-Lite0 bf16
decoded in 13.3 ms instead of 11.4. The loops over a whole segment are ``helper`` too, called once
per segment: each constant form or width (literal arguments) is a specialisation compiled on its
own, where the inlining pass had copied the whole loop, its nested helpers with it, into the kernel
at every call site, at a cost that grows faster than the code. The lossless golden stream's decode
then compiled in 46 s instead of 69, and decoded as fast. Numba does not prune a branch on a
literal argument: every branch of a specialisation is compiled. Where the branches are loops of
one float format each, an ``overload`` chooses them by the array's type as the kernel compiles
(``_split_at_constant_widths``).

``float_kernel`` and ``float_helper`` are for kernels that stand for NumPy's float expressions
(a checkpoint series' arithmetic over whole tensors): NumPy's error model, so that a division by
zero gives what NumPy's gives, an infinity or a NaN, and the loops vectorise.

``parallel_kernel`` is for the few kernels that split independent rows across threads with
``numba.prange`` (the entropy-bounded matrix formats). Launching a parallel region costs a few
microseconds, so callers keep a serial path (a plain ``kernel``) for small inputs.

Where Numba finds no writable place for its cache (a read-only install, an unwritable home), the
kernels are cached in a temporary directory for this process instead, with one warning.

Numba keys a kernel's cache on the kernel's own source file only (recent releases on its
contents): a kernel that calls kernels of another module (the trellis codes through the level coder's
``_encode_span``, the float coder's mode 4 through its fronts) would go on running their old machine
code after that module alone changed, as a checkout's files do, and as an upgrade's do where some
kernel files are left as they were. So the package keeps a stamp of its kernel modules in each place
Numba may cache them (beside the modules, under ``NUMBA_CACHE_DIR``, in the user-wide cache) and drops
every cached kernel there when any of them changes.
"""

import glob
import os
import tempfile
import warnings

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.cpython.unsafe.numbers import trailing_zeros as _hardware_trailing_zeros
from numba.extending import intrinsic

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


STAMP_NAME = "kernel-sources.stamp"


def _cache_subpath(directory: str) -> str:
    """The directory Numba gives the kernels of the modules in ``directory`` under a cache root of
    its own (``NUMBA_CACHE_DIR``, the user-wide cache), as Numba's own locators name it (from a
    module's path: only its directory counts)."""
    from numba.core.caching import _CacheLocator
    return _CacheLocator.get_suitable_cache_subpath(os.path.join(os.path.abspath(directory), "__init__.py"))


def _user_wide_cache() -> str | None:
    """Numba's user-wide cache root, where it caches the kernels of a read-only install."""
    try:
        from numba.misc.appdirs import AppDirs
        return AppDirs(appname="numba", appauthor=False).user_cache_dir
    except (ImportError, AttributeError):  # pragma: no cover (another Numba)
        return None


def _refresh(stamp: str, places: list[str], marker: str, create: bool) -> bool:
    """Drop the Numba caches in ``places`` unless ``marker`` holds ``stamp``, then write it (with
    ``create`` False, only where one of the places exists already). False where it cannot write."""
    try:
        if not create and not any(os.path.isdir(p) for p in places):
            return True
        try:
            with open(marker, encoding="utf-8") as f:
                if f.read() == stamp:
                    return True
        except OSError:
            pass
        for place in places:
            for cached in glob.glob(os.path.join(place, "*.nb[ic]")):
                try:
                    os.remove(cached)
                except FileNotFoundError:  # (another process dropped it first)
                    pass
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        partial = f"{marker}.{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(stamp)
        os.replace(partial, marker)
        return True
    except OSError:
        return False


def drop_stale_caches(root: str) -> None:
    """Remove the Numba caches of the package at ``root`` unless its kernel modules are those the
    stamp of each cache place names; then stamp them. The places: beside the modules
    (``__pycache__``), under ``NUMBA_CACHE_DIR`` when it is set, and in the user-wide cache where the
    package's own directories cannot be written (Numba's own order of choice)."""
    try:
        # (and this module: its intrinsics are compiled into the kernels that call them)
        sources = sorted(glob.glob(os.path.join(root, "*", "_*kernels.py")) + glob.glob(os.path.join(root, "_jit.py")))
        stamp = "\n".join(f"{os.path.relpath(p, root)} {st.st_mtime_ns} {st.st_size}"
                          for p in sources for st in [os.stat(p)])
    except OSError:
        return
    # (every subpackage's kernels, as Numba files them by directory: not only the kernel modules')
    directories = [root, *sorted(os.path.normpath(d) for d in glob.glob(os.path.join(root, "*", ""))
                                 if os.path.basename(os.path.normpath(d)) != "__pycache__")]
    in_tree = _refresh(stamp, [os.path.join(d, "__pycache__") for d in directories],
                       os.path.join(root, "__pycache__", STAMP_NAME), create=True)
    for base, active in ((numba.config.CACHE_DIR, True), (_user_wide_cache(), not in_tree)):
        if base:
            _refresh(stamp, [os.path.join(base, _cache_subpath(d)) for d in directories],
                     os.path.join(base, _cache_subpath(root), STAMP_NAME), create=active)


drop_stale_caches(os.path.dirname(os.path.abspath(__file__)))
kernel = _cached(nogil=True)
inline = _cached(inline="always")
helper = _cached()
# (for kernels that stand for NumPy's float expressions: a division by zero gives an infinity or a
# NaN, as NumPy's does, not the exception of Python's model, whose check per division also keeps
# the loop from being vectorised)
float_kernel = _cached(nogil=True, error_model="numpy")
float_helper = _cached(error_model="numpy")
parallel_kernel = _cached(parallel=True, nogil=True)


def _python_trailing_zeros(x):
    """The trailing zero bits of the nonzero integer ``x``."""
    x = int(x)
    return (x & -x).bit_length() - 1


# The processor's own count (one instruction, where a de Bruijn multiplication and a table load took
# a fifth of mode 3's split); the pure-Python path counts in Python: an intrinsic runs only compiled.
trailing_zeros = _python_trailing_zeros if numba.config.DISABLE_JIT else _hardware_trailing_zeros


@intrinsic
def _unaligned_u64(typingctx, array, byte):
    """The eight bytes at byte offset ``byte`` of a contiguous array's data, little-endian (the
    machine's order: Numba runs on little-endian machines only), unchecked."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"
            and isinstance(byte, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])
        return builder.load(builder.bitcast(at, ir.IntType(64).as_pointer()), align=1)

    return types.uint64(array, byte), codegen


@intrinsic
def _unaligned_store_u64(typingctx, array, byte, value):
    """Store ``value`` (uint64) as the eight bytes at byte offset ``byte`` of a contiguous array's
    data, little-endian, unchecked."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"
            and isinstance(byte, types.Integer) and value == types.uint64):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])
        builder.store(args[2], builder.bitcast(at, ir.IntType(64).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(array, byte, value), codegen


@intrinsic
def _raw_copy(typingctx, dst, dst_byte, src, src_byte, nbytes):
    """``nbytes`` bytes of a contiguous array's data from byte ``src_byte`` on into another's from
    byte ``dst_byte`` on, by the C library's memcpy, unchecked (the two ranges must not overlap)."""
    for a in (dst, src):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"):
            return None
    if not all(isinstance(v, types.Integer) for v in (dst_byte, src_byte, nbytes)):
        return None

    def codegen(context, builder, signature, args):
        def intp(k):  # (any integer type of the offsets and the count, as the machine's word)
            return context.cast(builder, args[k], signature.args[k], types.intp)

        def at(k):
            data = context.make_array(signature.args[k])(context, builder, args[k]).data
            return builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [intp(k + 1)])

        cgutils.raw_memcpy(builder, at(0), at(2), intp(4), context.get_constant(types.intp, 1), align=1)
        return context.get_dummy_value()

    return types.none(dst, dst_byte, src, src_byte, nbytes), codegen


@helper
def _copy_fits(dst, dst_byte, src, src_byte, nbytes):
    """Whether a copy of ``nbytes`` bytes from byte ``src_byte`` of ``src`` to byte ``dst_byte`` of
    ``dst`` (contiguous, 1-d) lies inside both arrays."""
    return (nbytes >= 0 and dst_byte >= 0 and src_byte >= 0 and dst_byte + nbytes <= dst.shape[0] * dst.itemsize
            and src_byte + nbytes <= src.shape[0] * src.itemsize)


if numba.config.DISABLE_JIT:
    def load_le64(array, byte):
        """The eight bytes of ``array`` (contiguous, 1-d) from byte ``byte`` on, as a little-endian
        uint64; they must lie inside the array."""
        data = array.view(np.uint8)
        byte = int(byte)
        if byte < 0 or byte + 8 > data.shape[0]:
            raise IndexError(f"eight bytes from byte {byte} of a {data.shape[0]}-byte array")
        return np.uint64(int.from_bytes(data[byte:byte + 8].tobytes(), "little"))

    def store_le64(array, byte, value):
        """Store the uint64 ``value`` little-endian as the eight bytes of ``array`` (contiguous,
        1-d) from byte ``byte`` on; they must lie inside the array."""
        data = array.view(np.uint8)
        byte = int(byte)
        if byte < 0 or byte + 8 > data.shape[0]:
            raise IndexError(f"eight bytes from byte {byte} of a {data.shape[0]}-byte array")
        data[byte:byte + 8] = np.frombuffer(int(value).to_bytes(8, "little"), dtype=np.uint8)

    def copy_bytes(dst, dst_byte, src, src_byte, nbytes):
        """Copy ``nbytes`` bytes of ``src`` (contiguous, 1-d) from byte ``src_byte`` on into ``dst``
        (the same) from byte ``dst_byte`` on; both ranges must lie inside their arrays and not
        overlap."""
        dst_byte, src_byte, nbytes = int(dst_byte), int(src_byte), int(nbytes)
        if not _copy_fits(dst, dst_byte, src, src_byte, nbytes):
            raise IndexError(f"a copy of {nbytes} bytes outside its arrays")
        dst.view(np.uint8)[dst_byte:dst_byte + nbytes] = src.view(np.uint8)[src_byte:src_byte + nbytes]
elif numba.config.BOUNDSCHECK:
    # (the fuzz targets run with bounds checks: an unchecked read would hide what they look for)
    @inline
    def load_le64(array, byte):
        if byte < 0 or byte + 8 > array.shape[0] * array.itemsize:
            raise IndexError("an unaligned read outside its array")
        return _unaligned_u64(array, byte)

    @inline
    def store_le64(array, byte, value):
        if byte < 0 or byte + 8 > array.shape[0] * array.itemsize:
            raise IndexError("an unaligned write outside its array")
        _unaligned_store_u64(array, byte, value)

    @inline
    def copy_bytes(dst, dst_byte, src, src_byte, nbytes):
        if not _copy_fits(dst, dst_byte, src, src_byte, nbytes):
            raise IndexError("a copy outside its arrays")
        _raw_copy(dst, dst_byte, src, src_byte, nbytes)
else:
    @inline
    def load_le64(array, byte):
        """One load for what two aligned words, a shift and an OR would take."""
        return _unaligned_u64(array, byte)

    @inline
    def store_le64(array, byte, value):
        """One store of eight bytes at any byte offset."""
        _unaligned_store_u64(array, byte, value)

    @inline
    def copy_bytes(dst, dst_byte, src, src_byte, nbytes):
        """One memcpy in place of Numba's slice assignment (MiniLM's lossless encoding at one thread,
        scratch: bf16 60.8-62.2 -> 58.2-59.0 ms, fp16 62.3-64.0 -> 59.9-61.2)."""
        _raw_copy(dst, dst_byte, src, src_byte, nbytes)


def host_features() -> frozenset[str]:
    """The instruction set extensions (``"+avx2"``, ``"+vpclmulqdq"``, ...) of the processor the
    kernels are compiled for, as LLVM names them: none with the JIT off, with a cache for another
    processor (``NUMBA_CPU_NAME``: no instruction beyond the baseline assumed) or with
    DEEPCABAC_SCALAR_STEPS=1 (the kernels' one-element-at-a-time paths, as the tests run them)."""
    if numba.config.DISABLE_JIT or os.environ.get("DEEPCABAC_SCALAR_STEPS") == "1":
        return frozenset()
    if numba.config.CPU_NAME not in (None, "host"):
        return frozenset()
    features = numba.config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return frozenset(features.split(","))


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
