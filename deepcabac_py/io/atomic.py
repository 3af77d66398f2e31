"""Atomic file output, and the wording of operating-system errors.

:func:`write_atomic` writes to a temporary file in the destination directory, flushes and fsyncs it,
then moves it into place with :func:`os.replace` (or a hard link when overwriting is not allowed, so
that a file created concurrently is never clobbered). Readers therefore see either the old file or the
complete new one, and a failure never leaves a partial output or a stray temporary file behind.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # (not on Windows, which has no O_DIRECT either)
    fcntl = None  # type: ignore[assignment]

from ..errors import OutputError, OutputExistsError

__all__ = ["write_atomic", "AppendingWriter", "os_reason"]

Writer = Callable[[BinaryIO], None]


def _exists_error(path: str) -> OutputExistsError:
    return OutputExistsError(f"output file {path} already exists; use --force to overwrite it")


_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "no such file",
    errno.EISDIR: "it is a directory",
}


def os_reason(exc: OSError) -> str:
    """A short, lower-case reason for an operating-system error: one wording per kind of failure,
    on input and on output alike."""
    reason = _REASONS.get(exc.errno) if exc.errno is not None else None
    return reason or exc.strerror or str(exc) or type(exc).__name__


def _os_error(path: str, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {os_reason(exc)}")


def _open_temp(directory: str, base: str) -> tuple[str, int]:
    """Create a fresh temporary file next to the output (mode 0o666 minus the umask, like open())."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        name = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            return name, os.open(name, flags, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "could not create a unique temporary file", directory)


def _fsync_dir(directory: str) -> None:
    """Best effort: make the rename durable. Not all platforms/filesystems allow opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
    except OSError:
        pass


def is_special_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` names (through any links) a device, a FIFO or a socket: written in place,
    as zstd does, never replaced by a file, and without ``force``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


def _write_in_place(path: str, data) -> None:
    if callable(data) and not isinstance(data, (bytes, bytearray, memoryview)):
        # writers may seek: they write into memory first, the device or pipe gets the bytes once
        buf = io.BytesIO()
        data(buf)
        data = buf.getvalue()
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise _os_error(path, exc) from exc


# Outputs of this size or more, written by an appending writer, bypass the page cache: copying
# gigabytes into it costs more CPU time than the writing itself (on this project's virtual
# machines, whose freshly used memory the host backs page by page, 2.2 GB took 4.5-5.4 s of kernel
# time buffered and 0.16 s with O_DIRECT), and a restored checkpoint that large gains little from
# staying cached.
UNCACHED_MIN = 1 << 26
_UNCACHED_BLOCK = 1 << 24  # staging buffer: every direct write is one whole, aligned block
_ALIGN = 4096


@dataclass(frozen=True)
class AppendingWriter:
    """A writer (a callable taking a binary file) that only appends, never seeks nor reads back,
    and the number of bytes it writes: what lets :func:`write_atomic` write a large output around
    the page cache."""

    write: Writer
    size: int

    def __call__(self, f: BinaryIO) -> None:
        self.write(f)


def _uncached(fd: int) -> bool:
    """Switch ``fd`` to O_DIRECT; False where the platform or file system does not allow it."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct or fcntl is None:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | direct)
    except OSError:
        return False
    return True


class _UncachedFile:
    """An append-only binary file over an O_DIRECT descriptor: bytes gather in a page-aligned
    staging buffer written out a whole block at a time; the last, partial block is written padded
    and the file cut back to its length. Where the file system refuses a direct write after all,
    the descriptor falls back to ordinary writes."""

    def __init__(self, fd: int):
        self._fd = fd
        self._staging = mmap.mmap(-1, _UNCACHED_BLOCK)
        self._view = memoryview(self._staging)
        self._fill = 0  # staged bytes
        self._written = 0  # bytes in the file

    def write(self, data) -> int:
        src = memoryview(data).cast("B")
        total = len(src)
        while len(src):
            n = min(len(src), _UNCACHED_BLOCK - self._fill)
            self._view[self._fill:self._fill + n] = src[:n]
            self._fill += n
            src = src[n:]
            if self._fill == _UNCACHED_BLOCK:
                self._drain(_UNCACHED_BLOCK)
        return total

    def tell(self) -> int:
        return self._written + self._fill

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Write what is staged; the file then has exactly the bytes written so far (a later write
        goes on without O_DIRECT, as the end is no longer aligned)."""
        if not self._fill:
            return
        length = self._fill
        padded = -(-length // _ALIGN) * _ALIGN
        self._view[length:padded] = bytes(padded - length)
        self._drain(padded)
        os.ftruncate(self._fd, self._written - padded + length)
        self._written += length - padded
        self._buffered()
        os.lseek(self._fd, self._written, os.SEEK_SET)

    def _drain(self, n: int) -> None:
        done = 0
        while done < n:
            try:
                done += os.write(self._fd, self._view[done:n])
            except OSError as exc:
                if exc.errno != errno.EINVAL or done:
                    raise
                self._buffered()  # the file system took O_DIRECT at open but not for writing
        self._written += n
        self._fill = 0

    def _buffered(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~getattr(os, "O_DIRECT", 0))

    def __enter__(self) -> _UncachedFile:
        return self

    def __exit__(self, *exc) -> None:
        self._view.release()
        self._staging.close()
        os.close(self._fd)


def write_atomic(
    path: str | os.PathLike,
    data: bytes | bytearray | memoryview | Writer,
    *,
    force: bool = False,
    mode: int | None = None,
) -> None:
    """Write ``data`` to ``path`` atomically.

    ``data`` is either a bytes-like object or a callable that receives a writable, seekable binary file
    object and writes the content into it. If ``path`` already exists and ``force`` is false,
    :class:`OutputExistsError` is raised and nothing is written. Operating-system errors (disk full,
    permission denied, missing directory, ...) are raised as :class:`OutputError`; any other exception
    from the writer callable propagates unchanged. In every failure case the temporary file is removed
    and an existing ``path`` is left untouched. ``mode`` sets the new file's permission bits (default:
    those of the file it replaces, else 0o666 minus the umask). A device, FIFO or socket at ``path`` is
    written in place (no temporary file, no rename, ``force`` not needed).

    An :class:`AppendingWriter` of at least :data:`UNCACHED_MIN` bytes bypasses the page cache
    where the file system allows it (``O_DIRECT``), through an aligned staging buffer.
    """
    if not (isinstance(data, (bytes, bytearray, memoryview)) or callable(data)):
        raise TypeError(f"data must be bytes-like or a callable taking a binary file, not {type(data).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if is_special_file(path):
        _write_in_place(path, data)
        return
    directory = os.path.dirname(path) or os.curdir
    base = os.path.basename(path)
    if not base:
        raise OutputError(f"cannot write {path}: not a file path")

    # Cheap early refusal (the final link below is the authoritative, race-free check).
    existing_mode = None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _os_error(path, exc) from exc
    if st is not None or os.path.islink(path):
        if not force:
            raise _exists_error(path)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise OutputError(f"cannot write {path}: it is a directory")
        if st is not None and stat.S_ISREG(st.st_mode):
            existing_mode = stat.S_IMODE(st.st_mode)

    tmp_name = None
    try:
        try:
            tmp_name, fd = _open_temp(directory, base)
        except OSError as exc:
            raise _os_error(path, exc) from exc
        if isinstance(data, AppendingWriter) and data.size >= UNCACHED_MIN and _uncached(fd):
            with _UncachedFile(fd) as out:
                # (an append-only file: all an AppendingWriter uses of one)
                data(out)  # type: ignore[arg-type]
                out.flush()
                os.fsync(fd)
        else:
            with os.fdopen(fd, "w+b") as f:
                if callable(data) and not isinstance(data, (bytes, bytearray, memoryview)):
                    data(f)
                else:
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
        new_mode = mode if mode is not None else existing_mode
        if new_mode is not None:
            try:
                os.chmod(tmp_name, new_mode)
            except OSError:
                pass

        if force:
            os.replace(tmp_name, path)
        else:
            try:
                # link() fails if the destination exists: no window in which a new file could be clobbered.
                os.link(tmp_name, path)
            except FileExistsError:
                raise _exists_error(path) from None
            except OSError:
                # Filesystem without hard links: fall back to check-then-rename.
                if os.path.lexists(path):
                    raise _exists_error(path) from None
                os.replace(tmp_name, path)
            else:
                _remove_quietly(tmp_name)
        tmp_name = None
        _fsync_dir(directory)
    except OSError as exc:
        if tmp_name is not None:
            _remove_quietly(tmp_name)
        raise _os_error(path, exc) from exc
    except BaseException:
        if tmp_name is not None:
            _remove_quietly(tmp_name)
        raise
