"""Input helpers shared by the CLI's commands."""

from __future__ import annotations

import sys

from deepcabac_py.errors import InputError


def read_input(path: str) -> bytes:
    """The whole content of ``path``, or of stdin for ``-``; unreadable files raise InputError."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
