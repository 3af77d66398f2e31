"""What the CLI's commands share: reading inputs, writing outputs, and wording errors."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from contextlib import contextmanager

import click

from deepcabac_py.errors import DeepCabacError, OutputError, OutputExistsError
from deepcabac_py.io.atomic import os_reason, write_atomic
from deepcabac_py.io.inputs import read_file, unreadable
from deepcabac_py.io.kinds import SUFFIX_OF_KIND


def read_input(path: str) -> bytes:
    """The whole content of ``path``, or of stdin for ``-``; unreadable files raise InputError."""
    if path == "-":
        return sys.stdin.buffer.read()
    return read_file(path)


def peek(path: str, n: int = 8) -> bytes:
    """The first ``n`` bytes of ``path``."""
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as exc:
        raise unreadable(path, exc) from None


def echo_info(quiet: bool, message: str) -> None:
    if not quiet:
        click.echo(message, err=True)


@contextmanager
def checkpoint_path(path: str, kind: str | None, data: bytes | None = None):
    """A file path for a checkpoint given as a path or as stdin (spooled to a temporary file;
    ``data``: what was already read from stdin)."""
    if path != "-":
        yield path
        return
    if data is None:
        data = sys.stdin.buffer.read()
    suffix = SUFFIX_OF_KIND.get(kind or "", "")
    with tempfile.TemporaryDirectory(prefix="deepcabac-") as tmp:
        spooled = os.path.join(tmp, "stdin" + suffix)
        with open(spooled, "wb") as f:
            f.write(data)
        yield spooled


def abandon_stdout() -> None:
    """After a failed write, point stdout at /dev/null: the interpreter's final flush would otherwise
    fail again and print a traceback of its own."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def write_output(path: str, data_or_writer, force: bool, mode: int | None = None) -> None:
    if path == "-":
        if sys.stdout.isatty():
            raise OutputError("refusing to write binary data to a terminal; use -o FILE or redirect stdout")
        if callable(data_or_writer):
            buf = io.BytesIO()
            data_or_writer(buf)
            data_or_writer = buf.getvalue()
        try:
            sys.stdout.buffer.write(data_or_writer)
            sys.stdout.buffer.flush()
        except OSError as exc:
            abandon_stdout()
            if isinstance(exc, BrokenPipeError):
                raise OutputError("cannot write to stdout: the reading end of the pipe was closed") from None
            raise OutputError(f"cannot write to stdout: {os_reason(exc)}") from None
        return
    if os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    write_atomic(path, data_or_writer, force=force, mode=mode)


def check_output(path: str, force: bool) -> None:
    """Refuse early, before any work, what write_output would refuse at the end."""
    if path == "-":
        if sys.stdout.isatty():
            raise OutputError("refusing to write binary data to a terminal; use -o FILE or redirect stdout")
    elif os.path.isdir(path):
        raise OutputError(f"cannot write {path}: it is a directory")
    elif os.path.lexists(path) and not force:
        raise OutputExistsError(f"output file {path} already exists; use --force to overwrite it")


@contextmanager
def about(path: str):
    """Prefix library errors with the file they concern, as zstd and xz do."""
    try:
        yield
    except DeepCabacError as exc:
        name = "<stdin>" if path == "-" else path
        if name in str(exc):
            raise
        raise type(exc)(f"{name}: {exc}") from None


def input_mode(path: str) -> int | None:
    # The output keeps the input's permission bits (a private checkpoint stays private).
    try:
        return None if path == "-" else os.stat(path).st_mode & 0o777
    except OSError:
        return None


def same_file(a: str, b: str) -> bool:
    try:
        return a != "-" and b != "-" and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def ratio_words(ratio: float | None) -> str:
    if not ratio:
        return "-"
    return f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
