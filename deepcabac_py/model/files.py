"""Checkpoint files and directories in, stream files and directories out, in bounded memory.

:func:`encode_file` reads a safetensors checkpoint a tensor at a time and writes the stream as it is
coded (:func:`~deepcabac_py.model.encoder.write_stream`); :func:`decode_file` reads a stream file a
tensor's payload at a time and, for a safetensors output, writes each tensor as it is decoded. A
Hugging Face directory (:func:`encode_directory`, :func:`decode_directory`) is its shards one after
another, every other file carried byte for byte, the output built beside its target and renamed into
place at the end.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..errors import CorruptStreamError, InputError, PickleRefusedError
from ..io.atomic import AppendingWriter, write_atomic
from ..io.checkpoint import Checkpoint, is_plain_structure, plain_skeleton
from ..io.directories import built_beside, check_output_directory, copy_file, list_files, scan_directory
from ..io.files import SafetensorsLayout, checkpoint_writer, kind_from_suffix, safetensors_bytes, safetensors_code
from ..io.kinds import KINDS
from ..io.tensor_source import TensorSource, open_source
from .container import StreamHeader
from .decoder import StreamFile, checkpoint_of, iter_decoded, select
from .encoder import write_stream
from .parallel import Progress
from .settings import EncodeSettings

__all__ = ["STREAM_SUFFIX", "encode_file", "decode_file", "encode_directory", "decode_directory"]

STREAM_SUFFIX = ".dcb"


def encode_file(src: str | os.PathLike, dst: str | os.PathLike, *, input_format: str | None = None,
                force: bool = False, threads: int | None = None, progress: Progress | None = None,
                mode: int | None = None, **settings: Any) -> StreamHeader:
    """Encode the checkpoint file ``src`` into the stream file ``dst`` (atomically; ``force``
    replaces an existing one). A safetensors file is read a tensor at a time; other kinds are loaded
    whole. ``settings`` are those of :func:`~deepcabac_py.model.encoder.encode_model`. Returns the
    header written."""
    enc = EncodeSettings(**settings)
    with open_source(src, input_format) as source:
        written: list[StreamHeader] = []
        write_atomic(dst, stream_writer(source, enc, written, threads=threads, progress=progress), force=force,
                     mode=mode)
    return written[0]


def stream_writer(source: TensorSource, settings: EncodeSettings, written: list[StreamHeader], *,
                  threads: int | None = None, progress: Progress | None = None) -> Callable[[BinaryIO], None]:
    """A writer (for :func:`~deepcabac_py.io.atomic.write_atomic`) of ``source`` encoded, which
    appends the header it wrote to ``written``. (Written through the page cache: a stream is a
    fraction of its checkpoint, and is often decoded or checked right after.)"""
    def write(f: BinaryIO) -> None:
        written.append(write_stream(f, source, settings, threads=threads, progress=progress))

    return write


def decode_file(src: str | os.PathLike | StreamFile, dst: str | os.PathLike, *, kind: str | None = None,
                names: str | Iterable[str] | None = None, force: bool = False, threads: int | None = None,
                progress: Progress | None = None, max_elements: int | None = None,
                mode: int | None = None) -> str:
    """Decode the stream file ``src`` into the checkpoint file ``dst`` (atomically). ``kind``: from
    ``dst``'s suffix by default, else the kind that was encoded. A safetensors output is written a
    tensor at a time; torch and npz outputs are built whole. ``names`` (names or glob patterns)
    decodes only those tensors, into a flat checkpoint. Returns the kind written."""
    stream = src if isinstance(src, StreamFile) else StreamFile(src)
    try:
        kind = output_kind(stream.header, kind or kind_from_suffix(dst))
        write_atomic(dst, decoded_writer(stream, kind, names=names, threads=threads, progress=progress,
                                         max_elements=max_elements), force=force, mode=mode)
        return kind
    finally:
        if stream is not src:
            stream.close()


def output_kind(header: StreamHeader, kind: str | None) -> str:
    """The checkpoint kind to decode into: ``kind`` if given, else the kind that was encoded (torch
    for a mapping)."""
    original = header.metadata.get("kind")
    return kind or (original if original in KINDS else "torch")


def decoded_writer(stream, kind: str, *, names: str | Iterable[str] | None = None, threads: int | None = None,
                   progress: Progress | None = None, max_elements: int | None = None) -> Callable[[BinaryIO], None]:
    """A writer (for :func:`~deepcabac_py.io.atomic.write_atomic`) of the stream decoded as a
    ``kind`` checkpoint: safetensors a tensor at a time, the other kinds built whole."""
    header = stream.header
    if kind == "safetensors":
        layout = _safetensors_layout(header, names)

        def write(f: BinaryIO) -> None:
            data = ((name, safetensors_bytes(name, t)) for name, t in
                    iter_decoded(stream, order=layout.data_order, threads=threads, progress=progress,
                                 max_elements=max_elements, bits=True))
            layout.write(f, data)

        return AppendingWriter(write, layout.file_size)
    values = dict(iter_decoded(stream, names, threads=threads, progress=progress, max_elements=max_elements))
    ckpt = checkpoint_of(header, values) if names is None else _flat(values)
    return checkpoint_writer(ckpt, kind)


def _flat(values: dict[str, Any]) -> Checkpoint:
    return Checkpoint(tensors=values, skeleton=plain_skeleton(list(values)), kind="mapping")


def _safetensors_layout(header: StreamHeader, names) -> SafetensorsLayout:
    """The safetensors layout of the decoded stream (or of the chosen tensors, flat; a pattern that
    matches nothing is refused here, before any output is opened)."""
    entries = {e.name: e for e in header.tensors}

    def spec(name: str) -> tuple[str, str, list[int]]:
        e = entries[name]
        return name, safetensors_code(e.dtype.dtype_name), list(e.shape)

    if names is not None:
        chosen = [e.name for e in select(header, names)]
        return SafetensorsLayout.of([spec(n) for n in chosen], None, None, None, True)
    ckpt = checkpoint_of(header, {e.name: None for e in header.tensors if not e.is_alias})
    tensors = list(ckpt.tensors)
    plain = is_plain_structure(ckpt.skeleton, tensors, ckpt.aliases)
    text = header.metadata.get("safetensors_header")
    if text is not None:  # the file's own header: restored byte for byte
        layout = SafetensorsLayout.verbatim(text, [spec(n) for n in tensors], ckpt.metadata) \
            if isinstance(text, str) and plain and not ckpt.aliases else None
        if layout is None:
            raise CorruptStreamError("the safetensors header kept in the stream does not describe its tensors")
        return layout
    return SafetensorsLayout.of([spec(n) for n in tensors + list(ckpt.aliases)], ckpt.skeleton, ckpt.metadata,
                                ckpt.aliases, plain)


@dataclass
class DirectoryResult:
    """What a directory encode or decode did: per shard ``(input, output, input bytes, output
    bytes)``, and the files carried."""

    shards: list[tuple[str, str, int, int]] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)


def encode_directory(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False,
                     threads: int | None = None, progress: Progress | None = None,
                     **settings: Any) -> DirectoryResult:
    """Encode a checkpoint directory: every shard ``NAME`` becomes ``NAME.dcb`` in ``dst``, every
    other file (index, config, tokenizer) is carried byte for byte, and so is a torch file outside
    the index whose pickle weights-only loading refuses (a Trainer's ``training_args.bin`` and
    ``rng_state.pth``: never unpickled). The output is built in a temporary directory beside
    ``dst`` and renamed into place when complete."""
    src, dst = os.fspath(src), os.fspath(dst)
    layout = scan_directory(src)
    check_output_directory(dst, force, src)
    EncodeSettings(**settings)  # (bad settings refused before any work)
    result = DirectoryResult()
    with built_beside(dst, force) as tmp:
        refused = []
        for shard in layout.shards:
            out = _place(tmp, shard + STREAM_SUFFIX)
            try:
                header = encode_file(layout.full(shard), out, threads=threads, progress=progress, **settings)
            except PickleRefusedError:
                # (a Trainer's training_args.bin and rng_state.pth: never unpickled, carried as they are)
                if shard in layout.weight_map.values():
                    raise
                refused.append(shard)
                continue
            result.shards.append((shard, shard + STREAM_SUFFIX, os.path.getsize(layout.full(shard)),
                                  header.total_size))
        result.carried = _carry(src, tmp, layout.indexes + layout.others + refused)
    return result


def decode_directory(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False,
                     threads: int | None = None, progress: Progress | None = None,
                     max_elements: int | None = None) -> DirectoryResult:
    """Decode a directory made by :func:`encode_directory`: every ``NAME.dcb`` back to ``NAME``,
    every other file carried; built beside ``dst`` and renamed into place when complete."""
    src, dst = os.fspath(src), os.fspath(dst)
    streams, carried = stream_directory(src)
    check_output_directory(dst, force, src)
    result = DirectoryResult()
    with built_beside(dst, force) as tmp:
        for rel in streams:
            name = rel[: -len(STREAM_SUFFIX)]
            out = _place(tmp, name)
            decode_file(os.path.join(src, rel), out, threads=threads, progress=progress, max_elements=max_elements)
            result.shards.append((rel, name, os.path.getsize(os.path.join(src, rel)), os.path.getsize(out)))
        result.carried = _carry(src, tmp, carried)
    return result


def _place(root: str, rel: str) -> str:
    """The path of ``rel`` in ``root``, its parent directories made."""
    out = os.path.join(root, rel)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    return out


def _carry(src: str, tmp: str, files: list[str]) -> list[str]:
    """Copy the files that are carried as they are; returns them."""
    for rel in files:
        copy_file(os.path.join(src, rel), os.path.join(tmp, rel))
    return list(files)


def stream_directory(path: str) -> tuple[list[str], list[str]]:
    """The stream files (``*.dcb``) and the other files of an encoded directory (relative, sorted)."""
    files = list_files(path)
    streams = [rel for rel in files if rel.endswith(STREAM_SUFFIX)]
    if not streams:
        raise InputError(f"{path}: no model stream (*{STREAM_SUFFIX}) in the directory")
    return streams, [rel for rel in files if not rel.endswith(STREAM_SUFFIX)]
