"""Whole-model decoding: the header, then every tensor's substreams on a thread pool.

Memory is bounded by the payload: the header parser refuses a tensor whose shape its bytes cannot
code (``docs/format.md`` §6.5) before anything is allocated from it.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..entropy import chunk_layout, levelcoder, linear_prediction
from ..errors import CorruptStreamError, TruncatedStreamError
from ..io.checkpoint import Checkpoint, numpy_to_tensor, plain_skeleton, unflatten
from ..io.dtypes import DType
from ..quant.reconstruct import dq_indices, reconstruct_chunk, reconstruct_f32_inplace
from .container import FLAG_TORCH, Mode, StreamHeader, TensorEntry, check_max_elements, read_header
from .levels import QuantizedTensor, quantized
from .parallel import Progress, resolve_threads, run_largest_first


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


def decode_checkpoint(data, *, threads: int | None = None, progress: Progress | None = None,
                      max_elements: int | None = None) -> Checkpoint:
    """Decode a model stream into a :class:`Checkpoint` (flat tensors plus the original structure).

    Parameters are those of :func:`decode_model`.
    """
    threads = resolve_threads(threads)
    header = read_stream_header(data)
    values = _decode_entries(data, header, want_levels=False, threads=threads, progress=progress,
                             max_elements=max_elements)
    tensors, aliases = {}, {}
    for e in header.tensors:
        if e.is_alias:
            aliases[e.name] = header.tensors[e.alias_of].name
        else:
            tensors[e.name] = numpy_to_tensor(values[e.name], e.dtype.dtype_name, bool(e.flags & FLAG_TORCH))
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


def decode_model(data, *, threads: int | None = None, progress: Progress | None = None,
                 max_elements: int | None = None) -> Any:
    """Decode a stream made by :func:`~deepcabac_py.model.encoder.encode_model` back into the
    structure that was encoded.

    Parameters
    ----------
    data : bytes-like
        The whole stream.
    threads : int or None
        Worker threads (None: every core).
    progress : callable or None
        Called with the number of elements decoded, as they are.
    max_elements : int or None
        Refuse (:class:`~deepcabac_py.errors.LimitExceededError`) a stream whose tensors hold more
        elements: a bound of your own for untrusted input, tighter than the payload's.

    Returns
    -------
    object
        Tensors as the type they were given in (torch tensors or numpy arrays), with their dtypes
        and shapes; quantized floats hold ``level * step`` rounded to their dtype.
    """
    return unflatten(decode_checkpoint(data, threads=threads, progress=progress, max_elements=max_elements))


def decode_levels(data, *, threads: int | None = None, max_elements: int | None = None) -> dict[str, QuantizedTensor]:
    """The integer levels and steps of every level-coded tensor, for integer inference.

    Parameters
    ----------
    data : bytes-like
        The whole stream.
    threads, max_elements
        As for :func:`decode_model`.

    Returns
    -------
    dict of str to QuantizedTensor
        Levels (int32, the tensor's shape; reconstruction indices for trellis tensors) and step
        of every tensor not stored raw; ``levels * step`` are the decoded values.
    """
    threads = resolve_threads(threads)
    header = read_stream_header(data)
    levels = _decode_entries(data, header, want_levels=True, threads=threads, progress=None,
                             max_elements=max_elements)
    return {e.name: quantized(e, levels[e.name]) for e in header.tensors if e.name in levels}


def _payload_views(data, header: StreamHeader, e: TensorEntry) -> list[memoryview]:
    base = header.header_size + e.offset
    view = memoryview(data)[base:base + e.size]
    if len(view) != e.size:
        raise TruncatedStreamError(f"tensor {e.name!r}: payload truncated")
    if zlib.crc32(view) != e.crc32:
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


def _decode_entries(data, header: StreamHeader, *, want_levels: bool, threads: int,
                    progress: Progress | None, max_elements: int | None = None) -> dict[str, np.ndarray]:
    """Decode every non-alias tensor: levels (int32) if ``want_levels`` else values (carrier dtype)."""
    check_max_elements(header, max_elements)
    outputs: dict[str, np.ndarray] = {}
    jobs = []
    for e in header.tensors:
        if e.is_alias:
            continue
        views = _payload_views(data, header, e)
        if e.mode == Mode.RAW:
            if not want_levels:
                outputs[e.name] = _raw_values(e, views)
            continue
        layout = chunk_layout.layout_from_stream(e.shape, e.chunk_elements, e.coder_param)
        predictor = None
        if e.is_linear:
            predictor = linear_prediction.from_bytes(views[0], chunk_layout.row_length(e.shape))
            views = views[1:]
        out = np.empty(e.numel, dtype=np.int32 if want_levels else e.dtype.carrier)
        outputs[e.name] = out
        for k, view in enumerate(views):
            jobs.append((e, layout, k, view, out, predictor))

    def levels_into(layout, k, view, predictor, window) -> None:
        if predictor is None:
            levelcoder.decode_chunk(view, layout, k, window)
            return
        residuals = np.empty_like(window)
        levelcoder.decode_chunk(view, layout, k, residuals)
        predictor.rebuild(residuals, window)

    def run(job) -> None:
        e, layout, k, view, out, predictor = job
        start, stop = layout.bounds(k)
        dependent = e.mode == Mode.DEPENDENT
        if want_levels:
            levels_into(layout, k, view, predictor, out[start:stop])
            if dependent:
                out[start:stop] = dq_indices(out[start:stop])
        elif e.mode.is_quantized and e.dtype == DType.FLOAT32:
            window = out[start:stop].view(np.int32)
            levels_into(layout, k, view, predictor, window)
            reconstruct_f32_inplace(window, e.step, dependent=dependent)
        else:
            levels = np.empty(stop - start, dtype=np.int32)
            levels_into(layout, k, view, predictor, levels)
            if e.mode.is_quantized:
                out[start:stop] = reconstruct_chunk(levels, e.step, e.dtype.dtype_name, dependent=dependent)
            else:
                out[start:stop] = _integers_from_levels(e, levels)
        if progress is not None:
            progress(stop - start)

    with linear_prediction.blas_threads(any(job[5] is not None for job in jobs)):
        run_largest_first(jobs, lambda job: job[1].size(job[2]), run, threads)
    for e in header.tensors:
        if e.name in outputs:
            outputs[e.name] = outputs[e.name].reshape(e.shape)
    return outputs
