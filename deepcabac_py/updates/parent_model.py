"""The parent model of an update: its tensors flat, in name order, and its SHA-256, by which a
message names the model it applies to."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass
class ParentTensor:
    name: str
    array: np.ndarray  # C-contiguous carrier array
    dtype: str
    is_torch: bool


def flat_model(model) -> dict[str, ParentTensor]:
    """name -> tensor, sorted by name. Accepts flat mappings of tensors and Checkpoints."""
    from ..io.checkpoint import Checkpoint, tensor_to_numpy

    tensors = model.tensors if isinstance(model, Checkpoint) else model
    if not isinstance(tensors, Mapping):
        raise TypeError(f"expected a mapping of tensors or a Checkpoint, got {type(model).__name__}")
    if tensors and all(isinstance(v, ParentTensor) for v in tensors.values()):
        return dict(sorted(tensors.items()))  # already flat
    out = {}
    for name in sorted(tensors):
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings, got {name!r}")
        arr, dtype, is_torch = tensor_to_numpy(tensors[name])
        out[name] = ParentTensor(name, arr, dtype, is_torch)
    return out


def model_hash(model) -> bytes:
    """SHA-256 of a model state: every tensor's name, dtype, shape and bytes, in name order."""
    return hash_flat(flat_model(model))


def hash_flat(flat: dict[str, ParentTensor]) -> bytes:
    h = hashlib.sha256()
    for name, t in flat.items():
        h.update(name.encode("utf-8") + b"\0" + t.dtype.encode() + b"\0")
        h.update(struct.pack(f"<I{t.array.ndim}Q", t.array.ndim, *t.array.shape))
        arr = t.array
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        h.update(np.ascontiguousarray(arr).data.cast("B"))
    return h.digest()


def rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    numel = math.prod(shape)
    if len(shape) >= 2 and shape[0] > 0 and numel > 0:
        return int(shape[0]), numel // int(shape[0])
    return 1, numel
