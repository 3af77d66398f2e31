"""The tensors of a checkpoint, one at a time.

The encoder reads a model through a :class:`TensorSource`: the names, shapes and dtypes of all its
tensors up front, and each tensor's values only when it is coded, so that no more than the tensors
in flight are in memory. A safetensors file is read that way straight from disk
(:class:`SafetensorsSource`: its header, then one tensor's bytes per read); everything else is
loaded whole and served from memory (:class:`CheckpointSource`).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass

import numpy as np

from .checkpoint import Checkpoint, RawTensor, TensorLike, dtype_name_of, plain_skeleton
from .files import (
    ST_ALIASES_KEY,
    ST_SKELETON_KEY,
    load_checkpoint,
    read_safetensors_index,
    safetensors_dtype,
)
from .inputs import check_readable_file, unreadable
from .kinds import kind_from_suffix, sniff_kind
from .lazy_torch import is_torch_tensor

__all__ = ["TensorSpec", "TensorSource", "CheckpointSource", "SafetensorsSource", "open_source"]


@dataclass(frozen=True)
class TensorSpec:
    """What is known of a tensor without reading it."""

    name: str
    shape: tuple[int, ...]
    dtype_name: str  # a name of :data:`deepcabac_py.io.dtypes.DTYPE_NAMES` (or one the codec refuses)
    is_torch: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorSource:
    """A checkpoint's structure and tensor table, with the tensors loaded on demand.

    ``names`` lists the tensors in checkpoint order (aliases excluded: ``aliases`` maps each to an
    earlier tensor); ``kind``, ``skeleton`` and ``metadata`` are those of
    :class:`~deepcabac_py.io.checkpoint.Checkpoint`. :meth:`load` may be called from several
    threads at once.
    """

    kind: str
    skeleton: dict
    metadata: dict[str, str] | None
    aliases: dict[str, str]
    names: list[str]
    file_header: str | None = None  # a safetensors file's JSON header as it is spelled

    def spec(self, name: str) -> TensorSpec:
        raise NotImplementedError

    def load(self, name: str) -> TensorLike:
        raise NotImplementedError

    def close(self) -> None:
        """Release the file this source reads (an in-memory source has none)."""

    def __enter__(self) -> TensorSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def numel(self) -> int:
        """Elements in all its tensors (an alias's are its target's, not counted twice)."""
        return sum(self.spec(n).numel for n in self.names)


class CheckpointSource(TensorSource):
    """A checkpoint already in memory."""

    def __init__(self, ckpt: Checkpoint):
        self.checkpoint = ckpt
        self.kind, self.skeleton, self.metadata = ckpt.kind, ckpt.skeleton, ckpt.metadata
        self.aliases = dict(ckpt.aliases)
        self.names = list(ckpt.tensors)
        self._specs = {}
        for name, t in ckpt.tensors.items():
            # (from the dtype alone: no conversion; an unsupported one is refused when it is planned)
            is_torch = is_torch_tensor(t) or isinstance(t, RawTensor)
            known = dtype_name_of(t) if is_torch or isinstance(t, np.ndarray) else None
            self._specs[name] = TensorSpec(name, tuple(map(int, t.shape)), known or str(getattr(t, "dtype", "?")),
                                           is_torch)

    def spec(self, name: str) -> TensorSpec:
        return self._specs[name]

    def load(self, name: str) -> TensorLike:
        return self.checkpoint.tensors[name]


class SafetensorsSource(TensorSource):
    """A safetensors file read one tensor at a time: the header is parsed and validated once, and
    each :meth:`load` reads that tensor's bytes and nothing else."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        check_readable_file(self.path)
        try:
            self._f = open(self.path, "rb")
        except OSError as exc:
            raise unreadable(self.path, exc) from None
        self._lock = threading.Lock()
        try:
            self._index = read_safetensors_index(self._f, self.path)
        except OSError as exc:
            self._f.close()
            raise unreadable(self.path, exc) from None
        except BaseException:
            self._f.close()
            raise
        meta = self._index.metadata
        # written by this library from a nested checkpoint: its skeleton and aliases are checked
        # against the values, so open_source loads such a file whole
        self.structured = meta is not None and (ST_SKELETON_KEY in meta or ST_ALIASES_KEY in meta)
        self.kind, self.metadata, self.aliases = "safetensors", meta, {}
        self.file_header = self._index.header_text
        self._position = {}
        self._specs = {}
        for i, (name, code, shape, _, _) in enumerate(self._index.entries):
            dtype_name, _ = safetensors_dtype(code)
            self._position[name] = i
            self._specs[name] = TensorSpec(name, tuple(shape), dtype_name, True)
        self.names = list(self._specs)
        self.skeleton = plain_skeleton(self.names)

    def spec(self, name: str) -> TensorSpec:
        return self._specs[name]

    def load(self, name: str) -> TensorLike:
        i = self._position[name]
        try:
            with self._lock:  # one file position
                return self._index.read_raw(self._f, i)
        except OSError as exc:
            raise unreadable(self.path, exc) from None

    def close(self) -> None:
        self._f.close()


def open_source(path: str | os.PathLike, kind: str | None = None, *, max_bytes: int | None = None) -> TensorSource:
    """A :class:`TensorSource` of the checkpoint file at ``path``: tensor by tensor from disk for a
    safetensors file, loaded whole (:func:`~deepcabac_py.io.files.load_checkpoint`) otherwise."""
    path = os.fspath(path)
    check_readable_file(path)
    if kind is None:
        kind = kind_from_suffix(path) or sniff_kind(path)
    if kind == "safetensors":
        source = SafetensorsSource(path)  # (its header read once)
        if not source.structured:
            return source
        source.close()
    return CheckpointSource(load_checkpoint(path, kind, max_bytes=max_bytes))
