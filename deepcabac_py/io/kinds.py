"""Kinds of checkpoint file, told from a file's name or its first bytes (no torch here)."""

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
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise unreadable(path, exc) from None
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, RuntimeError):
            return "torch"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"


def check_kind(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {', '.join(KINDS)}")
