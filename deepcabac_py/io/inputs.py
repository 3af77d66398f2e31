"""Reading input files: one error type and one wording for a file that cannot be read."""

from __future__ import annotations

import os

from ..errors import InputError
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
