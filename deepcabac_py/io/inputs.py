"""Reading inputs: one error type and one wording for a file that cannot be read, and reads in
bounded pieces (a pipe or a device is read only as far as the format says)."""

from __future__ import annotations

import os

from ..errors import InputError, TruncatedStreamError
from .atomic import os_reason


def unreadable(path: str | os.PathLike, exc: OSError) -> InputError:
    """The :class:`InputError` for an operating-system error while opening or reading ``path``."""
    return InputError(f"cannot read {os.fspath(path)}: {os_reason(exc)}")


def read_file(path: str | os.PathLike) -> bytes:
    """The whole content of ``path``; :class:`InputError` if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise unreadable(path, exc) from None


def check_readable_file(path: str) -> None:
    """:class:`InputError` unless ``path`` names an existing file that is not a directory."""
    if os.path.isdir(path):
        raise InputError(f"cannot read {path}: it is a directory")
    if not os.path.exists(path):
        raise InputError(f"cannot read {path}: no such file")


_PIECE = 1 << 24


def read_exactly(f, n: int, what: str) -> bytes:
    """``n`` bytes of the binary file object ``f``, read in pieces: an input shorter than it claims
    allocates only what it holds (TruncatedStreamError names ``what`` it ends in)."""
    parts, got = [], 0
    while got < n:
        try:
            part = f.read(min(_PIECE, n - got))
        except OSError as exc:
            raise InputError(f"cannot read the {what}: {exc.strerror or exc}") from None
        if not part:
            if got == 0 and what == "preamble":
                raise TruncatedStreamError("not a deepcabac stream: the input is empty")
            raise TruncatedStreamError(f"the input ends inside its {what} ({got:,} of {n:,} bytes)")
        parts.append(part)
        got += len(part)
    return b"".join(parts)
