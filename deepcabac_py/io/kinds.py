"""Kinds of file, told from a file's name or its first bytes (no torch here): the checkpoint kinds
this library reads, its own stream formats (their signatures are defined here), and, for a clear
message when a file is not what was expected, what else it may be."""

from __future__ import annotations

import os
import zipfile
from typing import Union

from .inputs import unreadable

KINDS = ("torch", "safetensors", "npz")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SUFFIX_OF_KIND = {"torch": ".pt", "safetensors": ".safetensors", "npz": ".npz"}
#: Largest safetensors header accepted (the reference implementation uses the same bound).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000

PathLike = Union[str, "os.PathLike[str]"]

#: The first eight bytes of a model stream (``docs/format.md`` §1) and of an update file (§U1).
STREAM_MAGIC = b"\x89DCB\r\n\x1a\n"
UPDATE_MAGIC = b"\x89DCU\r\n\x1a\n"
#: What :func:`what_it_is` needs of a file.
HEAD_BYTES = 64

_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"))


def what_it_is(head: bytes) -> str:
    """What a file starting with ``head`` (its first :data:`HEAD_BYTES` bytes) is, in words for an
    error message: "a deepcabac model stream (decode it with `deepcabac decode`)", "text
    ('hello world')", "an empty file"..."""
    if not head:
        return "an empty file"
    if head.startswith(STREAM_MAGIC):
        return "a deepcabac model stream (decode it with `deepcabac decode`)"
    if head.startswith(UPDATE_MAGIC):
        return "a deepcabac update file (apply it with `deepcabac update apply`)"
    for magic, name in _COMPRESSED:
        if head.startswith(magic):
            return f"{name}-compressed data (decompress it first)"
    if head[:4] == b"PK\x03\x04":
        return "a zip archive"
    if head[:1] == b"\x80":
        return "a pickle"
    if len(head) > 8 and head[8:9] == b"{":
        return "a safetensors file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        first = text.strip().splitlines()[0] if text.strip() else ""
        return f"text ({first[:40]!r})" if first else "blank text"
    return f"data of no known kind (it starts with {head[:8].hex(' ')})"


def read_head(path: str) -> bytes:
    """The first :data:`HEAD_BYTES` bytes of a file."""
    try:
        with open(path, "rb") as f:
            return f.read(HEAD_BYTES)
    except OSError as exc:
        raise unreadable(path, exc) from None


def kind_from_suffix(path: PathLike) -> str | None:
    """``"torch"``, ``"safetensors"`` or ``"npz"`` from the file suffix (case-insensitive), else ``None``."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in TORCH_SUFFIXES:
        return "torch"
    if suffix == ".safetensors":
        return "safetensors"
    if suffix == ".npz":
        return "npz"
    return None


def sniff_kind(path: str) -> str:
    head = read_head(path)
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, RuntimeError):
            return "torch"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "torch"
    if len(head) > 8 and head[8:9] == b"{":
        return "safetensors"
    return "torch"


def check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {', '.join(KINDS)}")
