"""Whole-model decoding: the header, then every tensor's substreams on a thread pool.

Memory is bounded by the payload: the header parser refuses a tensor whose shape its bytes cannot
code (``docs/format.md`` §6.5) before anything is allocated from it.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..entropy import chunk_layout, floatcoder, levelcoder, linear_prediction
from ..errors import CorruptStreamError, TruncatedStreamError
from ..io.checkpoint import Checkpoint, RawTensor, numpy_to_tensor, plain_skeleton, unflatten
from ..io.checksum import crc32
from ..io.dtypes import DType
from ..io.inputs import unreadable
from ..quant.log_domain import log_values
from ..quant.reconstruct import dq_indices, reconstruct_bf16_into, reconstruct_chunk, reconstruct_f32_inplace
from .container import (
    FLAG_TORCH,
    LOG_OFFSET_BYTES,
    Mode,
    StreamHeader,
    TensorEntry,
    check_max_elements,
    read_header,
    read_header_file,
)
from .levels import QuantizedTensor, quantized
from .parallel import ELEMENTS_IN_FLIGHT, Progress, pool_for, resolve_threads


class StreamFile:
    """A model stream in a file, read a tensor's payload at a time: its header once (validated
    against the file's size), then exactly the bytes of the tensors decoded."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.header = read_header_file(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as exc:
            raise unreadable(self.path, exc) from None

    def read(self, start: int, size: int) -> memoryview:
        try:
            data = os.pread(self._fd, size, start)
        except OSError as exc:
            raise unreadable(self.path, exc) from None
        return memoryview(data)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> StreamFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StreamBytes:
    """A model stream held in memory."""

    def __init__(self, data):
        self._data = memoryview(data)
        self.header = read_header(self._data)

    def read(self, start: int, size: int) -> memoryview:
        return self._data[start:start + size]

    def close(self) -> None:
        """(nothing to release)"""


def _open(source) -> tuple[StreamFile | StreamBytes, bool]:
    """The stream of ``source`` (bytes-like, a path, or an open :class:`StreamFile`), and whether
    it was opened here (and is to be closed)."""
    if isinstance(source, (StreamFile, StreamBytes)):
        return source, False
    if isinstance(source, (str, os.PathLike)):
        return StreamFile(source), True
    return StreamBytes(source), False


def select(header: StreamHeader, names: str | Iterable[str] | None) -> list[TensorEntry]:
    """The entries ``names`` choose (tensor names or glob patterns, matched against every name in
    the table) in table order; every entry for None. ValueError for a pattern that matches nothing."""
    if names is None:
        return list(header.tensors)
    patterns = [names] if isinstance(names, str) else list(names)
    chosen = set()
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"tensor names must be strings, got {pattern!r}")
        hits = [e.name for e in header.tensors if e.name == pattern or fnmatch.fnmatchcase(e.name, pattern)]
        if not hits:
            raise ValueError(f"no tensor of the stream matches {pattern!r}")
        chosen.update(hits)
    return [e for e in header.tensors if e.name in chosen]


def read_stream_header(data) -> StreamHeader:
    """The header of a model stream, without decoding any payload.

    Parameters
    ----------
    data : bytes-like
        The stream (the header alone is not enough: the tensor table is checked against the
        payload's length).

    Returns
    -------
    StreamHeader
        Format version, settings, metadata and the tensor table (names, shapes, dtypes, modes,
        qps, sizes).
    """
    return read_header(memoryview(data))


def decode_checkpoint(source, *, threads: int | None = None, progress: Progress | None = None,
                      max_elements: int | None = None) -> Checkpoint:
    """Decode a model stream into a :class:`Checkpoint` (flat tensors plus the original structure).

    Parameters are those of :func:`decode_model`.
    """
    stream, opened = _open(source)
    try:
        header = stream.header
        values = dict(iter_decoded(stream, threads=threads, progress=progress, max_elements=max_elements))
    finally:
        if opened:
            stream.close()
    return checkpoint_of(header, values)


def checkpoint_of(header: StreamHeader, values: Mapping[str, Any]) -> Checkpoint:
    """The checkpoint of a stream whose tensors decoded to ``values`` (aliases may be left out)."""
    tensors, aliases = {}, {}
    for e in header.tensors:
        if e.is_alias:
            aliases[e.name] = header.tensors[e.alias_of].name
        else:
            tensors[e.name] = values[e.name]
    meta = header.metadata
    skeleton = meta.get("skeleton")
    if skeleton is None:
        skeleton = plain_skeleton(list(tensors))
    if not isinstance(skeleton, dict):
        raise CorruptStreamError("stream metadata holds a malformed model skeleton")
    kind = meta.get("kind", "mapping")
    st_meta = meta.get("safetensors_metadata")
    return Checkpoint(tensors=tensors, skeleton=skeleton, kind=kind if isinstance(kind, str) else "mapping",
                      metadata=st_meta if isinstance(st_meta, dict) else None, aliases=aliases)


def decode_model(source, *, names: str | Iterable[str] | None = None, threads: int | None = None,
                 progress: Progress | None = None, max_elements: int | None = None) -> Any:
    """Decode a stream made by :func:`~deepcabac_py.model.encoder.encode_model` back into the
    structure that was encoded, or some of its tensors.

    Parameters
    ----------
    source : bytes-like, str or PathLike
        The whole stream, or the path of a stream file (read a tensor's payload at a time: with
        ``names``, only the header and the chosen tensors' payloads are read).
    names : str, iterable of str, or None
        Decode only these tensors (names or glob patterns such as ``"*.attention.*"``;
        ValueError for one that matches nothing) and return them as a flat ``{name: tensor}`` dict
        in table order. None: every tensor, in the structure that was encoded.
    threads : int or None
        Worker threads (None: every core).
    progress : callable or None
        Called with the number of elements decoded, as they are.
    max_elements : int or None
        Refuse (:class:`~deepcabac_py.errors.LimitExceededError`) a stream whose tensors (the chosen
        ones, with ``names``) hold more elements: a bound of your own for untrusted input, tighter
        than the payload's.

    Returns
    -------
    object
        Tensors as the type they were given in (torch tensors or numpy arrays), with their dtypes
        and shapes; quantized floats hold ``level * step`` rounded to their dtype.
    """
    if names is None:
        return unflatten(decode_checkpoint(source, threads=threads, progress=progress, max_elements=max_elements))
    return dict(iter_decoded(source, names, threads=threads, progress=progress, max_elements=max_elements))


def iter_decoded(source, names: str | Iterable[str] | None = None, *, order: Iterable[str] | None = None,
                 threads: int | None = None, progress: Progress | None = None, max_elements: int | None = None,
                 max_elements_in_flight: int = ELEMENTS_IN_FLIGHT, bits: bool = False) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` of the tensors ``names`` chooses (as :func:`decode_model`; an alias gives
    its target's values under its own name), decoded a few at a time: the chunks of the tensors
    after the one handed out run meanwhile, up to ``max_elements_in_flight`` elements (one tensor
    at least). ``order``: the chosen names in the order wanted (default: table order). ``bits``:
    every tensor as a :class:`~deepcabac_py.io.checkpoint.RawTensor` (for a file writer: no torch
    tensor is built)."""
    threads = resolve_threads(threads)
    stream, opened = _open(source)
    try:
        header = stream.header
        chosen = select(header, names)
        if order is not None:
            by_name = {e.name: e for e in chosen}
            chosen = [by_name[n] for n in order]
        # an alias holds its target's values
        coded = [header.tensors[e.alias_of] if e.is_alias else e for e in chosen]
        unique = {e.name: e for e in coded}
        check_max_elements(dataclasses.replace(header, tensors=list(unique.values())), max_elements)
        yield from _decode_in_order(stream, chosen, coded, threads, progress, max_elements_in_flight,
                                    output="bits" if bits else "tensors")
    finally:
        if opened:
            stream.close()


def decode_levels(source, *, threads: int | None = None, max_elements: int | None = None) -> dict[str, QuantizedTensor]:
    """The integer levels and steps of every level-coded tensor, for integer inference.

    Parameters
    ----------
    source : bytes-like, str or PathLike
        The whole stream, or the path of a stream file.
    threads, max_elements
        As for :func:`decode_model`.

    Returns
    -------
    dict of str to QuantizedTensor
        Levels (int32, the tensor's shape; reconstruction indices for trellis tensors) and step
        of every tensor not stored raw nor in the log domain (optimizer moments);
        ``levels * step`` are the decoded values.
    """
    threads = resolve_threads(threads)
    stream, opened = _open(source)
    try:
        header = stream.header
        check_max_elements(header, max_elements)
        # (values in the log domain are not levels times a step)
        # (nor are exact floats, nor integers by magnitude: these may not fit int32)
        coded = [e for e in header.tensors
                 if not e.is_alias and e.mode not in (Mode.RAW, Mode.LOG) and not e.mode.is_class_coded]
        levels = _decode_in_order(stream, coded, coded, threads, None, ELEMENTS_IN_FLIGHT, output="levels")
        return {e.name: quantized(e, values) for e, (_, values) in zip(coded, levels)}
    finally:
        if opened:
            stream.close()


def check_stream_file(path: str | os.PathLike) -> None:
    """Check a stream file without decoding it: its header, and every tensor's payload against its
    checksum (CorruptStreamError or TruncatedStreamError says what is wrong)."""
    with StreamFile(path) as stream:
        for e in stream.header.tensors:
            if not e.is_alias:
                _payload_views(stream, e)


def _payload_views(stream, e: TensorEntry) -> list[memoryview]:
    """The payload of ``e`` read, checked against its checksum and cut into its chunks."""
    view = stream.read(stream.header.header_size + e.offset, e.size)
    if len(view) != e.size:
        raise TruncatedStreamError(f"tensor {e.name!r}: payload truncated")
    if crc32(view) != e.crc32:
        raise CorruptStreamError(f"tensor {e.name!r}: payload checksum mismatch (the stream is damaged)")
    views, pos = [], 0
    for size in e.chunk_sizes:
        views.append(view[pos:pos + size])
        pos += size
    return views


def _raw_values(e: TensorEntry, views: list[memoryview]) -> np.ndarray:
    little = e.dtype.carrier.newbyteorder("<")
    parts = [np.frombuffer(v, dtype=little) for v in views]
    arr = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.empty(0, little))
    return arr.astype(e.dtype.carrier).reshape(e.shape)


def _integers_from_levels(e: TensorEntry, levels: np.ndarray) -> np.ndarray:
    """The values of a losslessly coded integer or boolean chunk, refused outside the dtype."""
    if e.dtype == DType.BOOL:
        if levels.size and (int(levels.min()) < 0 or int(levels.max()) > 1):
            raise CorruptStreamError(f"tensor {e.name!r}: a decoded boolean is neither 0 nor 1")
        return levels != 0
    info = np.iinfo(e.dtype.carrier)
    if levels.size and (int(levels.min()) < info.min or int(levels.max()) > info.max):
        raise CorruptStreamError(f"tensor {e.name!r}: a decoded integer is out of its dtype's range")
    return levels


class _Tensor:
    """One tensor being decoded: its payload read and checked, its output allocated, its chunks
    ready to run on any thread."""

    def __init__(self, stream, e: TensorEntry, want_levels: bool = False):
        self.entry, self.want_levels = e, want_levels
        self.ran = False  # (decoded together with others: see _run_small_together)
        views = _payload_views(stream, e)
        self.predictor = None
        self.log_offset = 0
        self.views: list[memoryview] = []
        if e.mode == Mode.RAW:
            self.out = _raw_values(e, views)
            return
        if e.mode.is_class_coded:
            self.views = views
            self.out = np.empty(e.numel, dtype=e.dtype.carrier)
            self.seg_len = floatcoder.segment_length(e.shape)
            return
        self.layout = chunk_layout.layout_from_stream(e.shape, e.chunk_elements, e.coder_param)
        if e.is_linear:
            self.predictor = linear_prediction.from_bytes(views[0], chunk_layout.row_length(e.shape))
            views = views[1:]
        if e.mode == Mode.LOG:  # (the header checked that the first substream is the offset's 8 bytes)
            self.log_offset = int.from_bytes(views[0][:LOG_OFFSET_BYTES], "little", signed=True)
            views = views[1:]
        self.views = views
        self.out = np.empty(e.numel, dtype=np.int32 if want_levels else e.dtype.carrier)

    def _levels_into(self, k: int, window: np.ndarray) -> None:
        if self.predictor is None:
            levelcoder.decode_chunk(self.views[k], self.layout, k, window)
            return
        residuals = np.empty_like(window)
        levelcoder.decode_chunk(self.views[k], self.layout, k, residuals)
        self.predictor.rebuild(residuals, window)

    def run(self, k: int) -> int:
        """Decode chunk ``k`` into the output; returns its element count."""
        e, out = self.entry, self.out
        if e.mode.is_class_coded:
            start, stop = e.even_chunk_bounds(k)
            where = f"tensor {e.name!r}, chunk {k}"
            if e.mode == Mode.MAGNITUDE:
                floatcoder.decode_magnitudes(self.views[k], self.seg_len, out[start:stop], where=where)
            else:
                floatcoder.decode_chunk(self.views[k], e.dtype.dtype_name, self.seg_len, out[start:stop], where,
                                        e.coder_param)
            return stop - start
        start, stop = self.layout.bounds(k)
        if self.want_levels:
            self._levels_into(k, out[start:stop])
            if e.mode == Mode.DEPENDENT:
                out[start:stop] = dq_indices(out[start:stop])
        else:
            values_into(e, lambda window: self._levels_into(k, window), out[start:stop], self.log_offset)
        return stop - start

    def result(self) -> np.ndarray:
        return self.out.reshape(self.entry.shape)


def values_into(e: TensorEntry, fill: Callable[[np.ndarray], None], out: np.ndarray, log_offset: int = 0) -> None:
    """The values of a chunk of level-coded entry ``e`` into ``out`` (its part of the tensor's
    carrier array): ``fill(window)`` writes the chunk's levels (int32, as its substream carries them)
    into ``window``. The decoder's one way from levels to values, for its substreams and for the
    levels an encoder has just coded (:func:`~.encoder.code_model`)."""
    dependent = e.mode == Mode.DEPENDENT
    step = e.step if e.step is not None else 0.0  # (used by quantized tensors only)
    if e.mode == Mode.LOG:
        levels = np.empty(out.shape[0], dtype=np.int32)
        fill(levels)
        out[:] = log_values(levels, log_offset, step, e.dtype.dtype_name)
    elif e.mode.is_quantized and e.dtype == DType.FLOAT32:
        window = out.view(np.int32)
        fill(window)
        reconstruct_f32_inplace(window, step, dependent=dependent)
    elif e.mode.is_quantized and e.dtype == DType.BFLOAT16:
        levels = np.empty(out.shape[0], dtype=np.int32)
        fill(levels)
        reconstruct_bf16_into(levels, step, out, dependent=dependent)
    else:
        levels = np.empty(out.shape[0], dtype=np.int32)
        fill(levels)
        if e.mode.is_quantized:
            out[:] = reconstruct_chunk(levels, step, e.dtype.dtype_name, dependent=dependent)
        else:
            out[:] = _integers_from_levels(e, levels)


def _decodes_together(t: _Tensor, work, dtype: DType) -> bool:
    """Whether ``t`` (``work``: its chunks' futures, None on this thread) is a small float tensor of
    ``dtype`` whose one substream is whole by tANS: what :func:`_run_small_together` batches."""
    e = t.entry
    return (work is None and not t.ran and e.mode == Mode.FLOAT and e.numel <= floatcoder.SMALL_TOGETHER
            and e.dtype == dtype and len(t.views) == 1 and bool(t.views[0])
            and floatcoder.whole_tans(t.views[0][0], e.coder_param, floatcoder.FORMATS[dtype.dtype_name][0]))


def _run_small_together(pending: collections.deque) -> None:
    """Decode the small float tensors of ``pending`` (:func:`_decodes_together`, of the dtype of the
    one at its front) in one kernel call, each into its own output, when the front is one of them.
    EfficientNet-Lite0 has 209 tensors below 4,096 elements: each cost more in the Python around
    its kernel than in the kernel. Those of the whole pending window go together, not only a run at
    its front: a model's biases and norms lie between its matrices (MiniLM bf16 took 39 calls for
    its 64, now one)."""
    _, front, work = pending[0]
    dtype = front.entry.dtype
    # (asked before each tensor is handed out: a large or decoded one answers at once)
    if not _decodes_together(front, work, dtype):
        return
    batch = [t for _, t, work in pending if _decodes_together(t, work, dtype)]
    if len(batch) < 2:
        return
    counts = np.array([t.entry.numel for t in batch], dtype=np.int64)
    starts = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum([len(t.views[0]) for t in batch], out=starts[1:])
    out = np.empty(int(counts.sum()), dtype=dtype.carrier)
    floatcoder.decode_tans_chunks(np.frombuffer(b"".join(t.views[0] for t in batch), dtype=np.uint8), starts, counts,
                                  np.array([t.seg_len for t in batch], dtype=np.int64), dtype.dtype_name, out,
                                  lambda j: f"tensor {batch[j].entry.name!r}, chunk 0")
    at = 0
    for t in batch:  # (copies: tensors sharing one buffer would share their storage)
        n = t.entry.numel
        t.out[:] = out[at:at + n]
        at += n
        t.ran = True


def _decode_in_order(stream, chosen: list[TensorEntry], coded: list[TensorEntry], threads: int,
                     progress: Progress | None, budget: int, *, output: str = "tensors") -> Iterator[tuple[str, Any]]:
    """Decode ``coded`` (the entries holding the values of ``chosen``) on a pool, the chunks of the
    tensors after the one handed out already running, and yield the chosen in order: as tensors of
    the type encoded (``output="tensors"``), as :class:`RawTensor` (``"bits"``) or as their int32
    levels (``"levels"``)."""
    want_levels = output == "levels"
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    pending: collections.deque = collections.deque()  # (chosen entry, _Tensor, futures or None)
    elements = 0
    ahead = 0  # the next of ``chosen`` to start
    try:
        # (no limit without a linear predictor: its setting and restoring cost a millisecond)
        with linear_prediction.blas_threads(pool is not None and any(e.is_linear for e in coded)):
            while ahead < len(chosen) or pending:
                while ahead < len(chosen) and (not pending or elements < budget):
                    t = _Tensor(stream, coded[ahead], want_levels)
                    runner = pool_for(pool, t.entry.numel)
                    work = [runner.submit(t.run, k) for k in range(len(t.views))] if runner is not None else None
                    pending.append((chosen[ahead], t, work))
                    elements += t.entry.numel
                    ahead += 1
                _run_small_together(pending)
                e, t, work = pending.popleft()
                counts = ((t.entry.numel,) if t.ran else (w.result() for w in work) if work is not None
                          else (t.run(k) for k in range(len(t.views))))
                for n in counts:
                    if progress is not None:
                        progress(n)
                elements -= t.entry.numel
                c = t.entry
                if want_levels:
                    yield e.name, t.result()
                elif output == "bits" and c.flags & FLAG_TORCH:
                    yield e.name, RawTensor(t.result(), c.dtype.dtype_name)
                else:
                    yield e.name, numpy_to_tensor(t.result(), c.dtype.dtype_name, bool(c.flags & FLAG_TORCH))
                del t
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
