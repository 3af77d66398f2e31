"""Whole-model encoding: plan, code, assemble.

:func:`encode_model` flattens any mapping of tensors (nested checkpoints included) and plans the
model (:mod:`.model_plan`: quantized floats, lossless integers, raw bytes). Tensors are then read
and planned one after another while the chunks of those before them are coded on a thread pool
(the kernels release the GIL); :func:`write_stream` keeps a few tensors in memory at a time and
the finished substreams in a spool until the header (:mod:`.container`) can be written before them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ..entropy import floatcoder, linear_prediction
from ..entropy.floatcoder import Buffer
from ..io.buffers import joined
from ..io.checkpoint import Checkpoint, numpy_to_tensor
from ..io.checksum import crc32
from ..io.tensor_source import TensorSource
from .container import (
    FLAG_TORCH,
    LOG_OFFSET_BYTES,
    Coder,
    Mode,
    StreamHeader,
    TensorEntry,
    raw_chunk_elements,
    read_header,
    write_header,
)
from .decoder import checkpoint_of, values_into
from .levels import QuantizedTensor, assembled
from .model_plan import ModelPlan, plan_model
from .parallel import ELEMENTS_IN_FLIGHT, Progress, pool_for, resolve_threads
from .settings import (
    DEFAULT_IMPORTANCE,
    DEFAULT_MOMENTS_QP,
    DEFAULT_QP,
    DEFAULT_QP_DENSITY,
    DEFAULT_QUANTIZER,
    EncodeSettings,
)
from .tensor_plan import TensorPlan


def encode_model(
    model: Mapping[str, Any] | Checkpoint | TensorSource,
    *,
    qp: int = DEFAULT_QP,
    qp_density: int = DEFAULT_QP_DENSITY,
    qp_1d: int | None = None,
    qp_overrides: Mapping[str, int] | None = None,
    keep_exact: bool | str | Iterable[str] = False,
    quantizer: str = DEFAULT_QUANTIZER,
    lambda_scale: float = 1.0,
    importance: Mapping[str, Any] | str | None = DEFAULT_IMPORTANCE,
    batchnorm_eps: float | Mapping[str, float] | None = None,
    bias_correction: bool = True,
    moments_qp: int = DEFAULT_MOMENTS_QP,
    threads: int | None = None,
    progress: Progress | None = None,
) -> bytes:
    """Compress a model: a state dict, any nested mapping of tensors, or a :class:`Checkpoint`.

    Float tensors are quantized, integer and boolean tensors coded losslessly, non-tensor entries
    kept; the stream decodes with :func:`decode_model` to the structure given.

    Parameters
    ----------
    model : mapping or Checkpoint
        Torch tensors or numpy arrays, nested in dicts, lists and tuples as a checkpoint holds them.
    qp, qp_density, qp_1d, qp_overrides, keep_exact, quantizer, lambda_scale, importance, \
batchnorm_eps, bias_correction, moments_qp
        The settings of :class:`~deepcabac_py.model.settings.EncodeSettings`. In short: ``qp``
        sets the step of tensors with two or more dimensions (lower: finer, more bytes) and
        ``qp_1d`` that of biases and norms (default six octaves finer); ``quantizer`` is
        ``"trellis"`` (default), ``"rdoq"`` or ``"nearest"``; ``importance`` is
        ``"structural"`` (default: from the model itself, without data), a mapping of per-weight
        importances (e.g. :func:`deepcabac_py.tuning.fisher.diagonal_fisher`), or None. An
        optimizer's state (``optimizer.state_dict()`` in the checkpoint) is recognised: steps
        kept exact, moments coded in the log domain at ``moments_qp``
        (:mod:`deepcabac_py.model.optimizer_state`).
    threads : int or None
        Worker threads (None: every core). The bytes do not depend on it.
    progress : callable or None
        Called with the number of elements coded, as they are.

    Returns
    -------
    bytes
        The stream; the same bytes for the same input and settings.

    Notes
    -----
    Under ``"nearest"`` and ``"rdoq"``, a tall matrix (16 rows per column or more, 48 to 4096
    columns) whose columns are correlated, such as a word embedding, is coded as the residuals of a
    linear prediction across its columns (:mod:`deepcabac_py.entropy.linear_prediction`; same
    levels, fewer bytes).
    """
    settings = EncodeSettings(qp=qp, qp_density=qp_density, qp_1d=qp_1d, qp_overrides=qp_overrides,
                              keep_exact=keep_exact, quantizer=quantizer, lambda_scale=lambda_scale,
                              importance=importance, batchnorm_eps=batchnorm_eps, bias_correction=bias_correction,
                              moments_qp=moments_qp)
    out = _Pieces()
    _write(out, model, settings, resolve_threads(threads), progress, _Payloads(), ELEMENTS_IN_FLIGHT)
    return joined(out.pieces)


@dataclass
class CodedTensor:
    """One tensor as coding left it: its table entry, its substreams, and its values as a decoder
    gives them back."""

    entry: TensorEntry
    chunks: list[Buffer]
    decoded: Any  # a torch tensor or numpy array, as decode_checkpoint returns it


@dataclass
class CodedModel:
    """A stream, the checkpoint it decodes to, and its tensors as coded (:func:`code_model`)."""

    data: bytes
    decoded: Checkpoint
    tensors: dict[str, CodedTensor]


def code_model(model: Mapping[str, Any] | Checkpoint, settings: EncodeSettings, *,
               reuse: Mapping[str, CodedTensor] | None = None, threads: int | None = None) -> CodedModel:
    """The stream of :func:`encode_model` together with what it decodes to, made from the levels as
    they are coded (the decoder's own reconstruction, without decoding a substream), for a writer
    that codes against its own output (a checkpoint series).

    ``reuse``: tensors already coded, alone, with the settings that reach them in this model
    (their entry, substreams and values are taken as they are instead of coding them again). The
    caller vouches for that: a tensor reused with other settings would not be the stream
    :func:`encode_model` makes."""
    out = _Pieces()
    payloads = _Payloads()
    written = _write(out, model, settings, resolve_threads(threads), None, payloads, ELEMENTS_IN_FLIGHT,
                     decode=True, reuse=reuse or {})
    data = joined(out.pieces)
    header = read_header(memoryview(data))
    coded = {name: CodedTensor(entry, payloads.chunks[name], written.decoded[name])
             for name, entry in written.entries.items()}
    return CodedModel(data, checkpoint_of(header, written.decoded), coded)


class _Pieces:
    """A write-only binary sink that keeps what it is given: the stream is joined once at the end
    instead of being copied into a growing buffer piece by piece."""

    def __init__(self):
        self.pieces: list[Buffer] = []

    def write(self, b: Buffer) -> int:
        self.pieces.append(b)
        return len(b)


def write_stream(out: BinaryIO, model: Mapping[str, Any] | Checkpoint | TensorSource, settings: EncodeSettings, *,
                 threads: int | None = None, progress: Progress | None = None, spool: BinaryIO | None = None,
                 max_elements_in_flight: int = ELEMENTS_IN_FLIGHT) -> StreamHeader:
    """Encode ``model`` into the binary file ``out`` tensor by tensor: the bytes of
    :func:`encode_model`, with no more than a few tensors in memory at a time when ``model`` is a
    :class:`~deepcabac_py.io.tensor_source.TensorSource` reading from disk.

    The substreams wait in ``spool`` (a binary file open for reading and writing; None: an
    anonymous temporary file) until the header that says where they are has been written; then they
    are copied to ``out`` in table order. ``max_elements_in_flight`` bounds the elements of the
    tensors loaded at once (one tensor at least). Returns the header written.
    """
    threads = resolve_threads(threads)
    if max_elements_in_flight < 1:
        raise ValueError(f"max_elements_in_flight must be positive, got {max_elements_in_flight!r}")
    with contextlib.ExitStack() as stack:
        if spool is None:
            spool = stack.enter_context(tempfile.TemporaryFile(prefix="deepcabac-"))
        written = _write(out, model, settings, threads, progress, _SpooledPayloads(spool), max_elements_in_flight)
    return read_header(written.header, total_size=len(written.header) + written.payload_size)


@dataclass
class _Written:
    header: bytes
    payload_size: int
    entries: dict[str, TensorEntry]  # the tensors' (not the aliases')
    decoded: dict[str, Any]  # the tensors' values as decoded (asked for with ``decode``)


def _write(out: BinaryIO | _Pieces, model: Mapping[str, Any] | Checkpoint | TensorSource, settings: EncodeSettings,
           threads: int, progress: Progress | None, payloads: _Payloads, max_elements_in_flight: int, *,
           decode: bool = False, reuse: Mapping[str, CodedTensor] | None = None) -> _Written:
    """Plan, code and write ``model`` (with ``decode``, its values as decoded as well)."""
    plan = plan_model(model, settings)
    with contextlib.ExitStack() as stack:
        pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        if pool is not None:  # (on an error or ^C, the chunks not started are dropped, not run)
            stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        # the linear prediction's matrix products run in the codec's own threads: one BLAS thread each
        # (none when every tensor is kept exact: the limit's setting and restoring cost a millisecond)
        stack.enter_context(linear_prediction.blas_threads(settings.quantizer in ("nearest", "rdoq")
                                                           and settings.keep_exact is not True))
        coder = _TensorCoder(plan, pool, progress, payloads, max_elements_in_flight, decode, reuse or {})
        targets = plan.shift_targets
        coder.code([n for n in plan.names if n not in targets])
        # the tensors that take out their layers' shifts, now that those layers are coded
        coder.code([n for n in plan.names if n in targets], shifted=True)
        entries = [coder.entries[n] for n in plan.names]
        offset = 0
        for e in entries:
            e.offset = offset
            offset += e.size
        entries += plan.alias_entries(coder.entries)
        header = write_header(settings.qp, settings.qp_1d_resolved, settings.qp_density, plan.metadata_json, entries)
        out.write(header)
        for name in plan.names:
            payloads.copy_to(out, name)
    return _Written(header, offset, {n: coder.entries[n] for n in plan.names}, coder.decoded)


class _Payloads:
    """The tensors' substreams as they are coded, kept until the header that says where they are has
    been written: in memory, for a caller that returns the whole stream as bytes."""

    def __init__(self):
        self.chunks: dict[str, list[Buffer]] = {}

    def add(self, entry: TensorEntry, chunks: list[Buffer]) -> None:
        """Store a tensor's chunks; its entry gets their sizes and checksum."""
        crc = 0
        for c in chunks:
            crc = crc32(c, crc)
        entry.chunk_sizes = [len(c) for c in chunks]
        entry.size = sum(entry.chunk_sizes)
        entry.crc32 = crc
        self._keep(entry.name, chunks)

    def _keep(self, name: str, chunks: list[Buffer]) -> None:
        self.chunks[name] = chunks

    def copy_to(self, out: BinaryIO | _Pieces, name: str) -> None:
        for c in self.chunks[name]:  # (kept: the pieces hold them until the stream is joined anyway)
            out.write(c)


class _SpooledPayloads(_Payloads):
    """The substreams kept in a spool file (a model streamed from disk need not fit in memory)."""

    def __init__(self, spool: BinaryIO):
        super().__init__()
        self.spool = spool
        self.end = spool.seek(0, io.SEEK_END)
        self.where: dict[str, tuple[int, int]] = {}

    def _keep(self, name: str, chunks: list[Buffer]) -> None:
        self.spool.seek(self.end)
        start = self.end
        for c in chunks:
            self.spool.write(c)
            self.end += len(c)
        self.where[name] = (start, self.end - start)

    def copy_to(self, out: BinaryIO | _Pieces, name: str) -> None:
        start, size = self.where[name]
        self.spool.seek(start)
        while size:
            piece = self.spool.read(min(size, COPY_PIECE))
            if not piece:
                raise RuntimeError("internal error: the spool file is shorter than what was written to it")
            out.write(piece)
            size -= len(piece)


COPY_PIECE = 1 << 24
SMALL_BATCH = 1 << 16  # elements of small tensors coded in one call at most


class _TensorCoder:
    """Tensors planned on the calling thread and their chunks coded on the pool, oldest first: a
    tensor's substreams are stored (and its memory released) once all its chunks are done."""

    def __init__(self, plan: ModelPlan, pool: ThreadPoolExecutor | None, progress: Progress | None,
                 payloads: _Payloads, budget: int, decode: bool = False,
                 reuse: Mapping[str, CodedTensor] | None = None):
        self.plan, self.pool, self.progress, self.payloads, self.budget = plan, pool, progress, payloads, budget
        self.decode, self.reuse = decode, reuse or {}
        self.entries: dict[str, TensorEntry] = {}
        self.decoded: dict[str, Any] = {}  # (with ``decode``) every tensor's values as decoded
        self.outputs: dict[str, np.ndarray] = {}  # (with ``decode``) level-coded tensors' values, chunk by chunk
        self.deltas: dict[str, Any] = {}  # shift target -> the sum of its layers' shifts
        self.shift_layers = plan.shift_layers  # (a set built from the shifts: once, not per tensor)

    def code(self, names: list[str], shifted: bool = False) -> None:
        in_flight: collections.deque = collections.deque()
        elements = 0
        small: list[TensorPlan] = []  # small floats kept exact, waiting to be coded in one call
        small_elements = 0
        for name in names:
            done = self.reuse.get(name)
            if done is not None and not shifted and name not in self.shift_layers:
                self._store_coded(name, done)
                continue
            if shifted and name in self.deltas:
                p = self.plan.with_shifts(name, self.deltas[name])
            else:
                p = self.plan.plan(name)
            p = p.with_linear_prediction()
            if not p.is_chunked:
                self._store_raw(p)
                continue
            keep = p.name in self.shift_layers
            e = p.entry
            if e.mode == Mode.FLOAT and not keep and floatcoder.codes_together(e.dtype.dtype_name, e.numel):
                if small and (small[0].entry.dtype != e.dtype or small_elements + e.numel > SMALL_BATCH):
                    self._finish_small(small)
                    small, small_elements = [], 0
                small.append(p)
                small_elements += e.numel
                continue
            if self.decode and p.is_level_coded:
                self.outputs[name] = np.empty(e.numel, dtype=e.dtype.carrier)
            jobs = [(p, k, keep) for k in range(p.chunk_count)]
            runner = pool_for(self.pool, p.entry.numel)
            work: list = [runner.submit(self._run, job) for job in jobs] if runner is not None else jobs
            in_flight.append((p, work))
            elements += p.entry.numel
            # (on one thread too, tensors are planned ahead up to the budget and then coded: Python
            # planning between two kernels ran at half the speed of planning in a loop of its own)
            while in_flight and elements > self.budget:
                elements -= self._finish(*in_flight.popleft())
        while in_flight:
            self._finish(*in_flight.popleft())
        if small:
            self._finish_small(small)

    def _finish_small(self, plans: list[TensorPlan]) -> None:
        """Code the small float tensors ``plans`` (one dtype, one chunk each) in one call and store them."""
        chunks = floatcoder.encode_small_chunks([p.values.reshape(-1) for p in plans], plans[0].entry.dtype.dtype_name,
                                                [floatcoder.segment_length(p.entry.shape) for p in plans])
        for p, data in zip(plans, chunks):
            if self.progress is not None:
                self.progress(p.entry.numel)
            self._store(p, [(data, None)])

    def _run(self, job: tuple[TensorPlan, int, bool]) -> tuple[Buffer, np.ndarray | None]:
        p, k, keep = job
        data, levels = p.encode_chunk(k)
        out = self.outputs.get(p.name)
        if out is not None and levels is not None:
            start, stop = p.chunks.bounds(k)
            values_into(p.entry, lambda window: np.copyto(window, levels), out[start:stop], p.log_offset or 0)
        if self.progress is not None:
            self.progress(p.chunk_size(k))
        return data, levels if keep else None

    def _finish(self, p: TensorPlan, work: list) -> int:
        return self._store(p, [w.result() if isinstance(w, Future) else self._run(w) for w in work])

    def _store(self, p: TensorPlan, done: list[tuple[Buffer, np.ndarray | None]]) -> int:
        """Store tensor ``p``'s coded chunks ``done`` (substream, levels kept or None); its element count."""
        chunks = [data for data, _ in done]
        raw_size = p.entry.numel * p.entry.dtype.itemsize
        if p.entry.mode.is_class_coded and sum(map(len, chunks)) >= raw_size:
            # (a few values: the frequency tables would cost more than they save)
            p.entry.mode, p.entry.coder = Mode.RAW, Coder.NONE
            self._store_raw(p, counted=True)
            return p.entry.numel
        if p.entry.mode == Mode.FLOAT:
            p.entry.coder_param = floatcoder.revision_of(chunks, p.entry.dtype.dtype_name)
        if p.linear is not None:
            chunks.insert(0, p.linear.to_bytes())
        if p.log_offset is not None:
            chunks.insert(0, p.log_offset.to_bytes(LOG_OFFSET_BYTES, "little", signed=True))
        if p.name in self.shift_layers:
            decoded = assembled(p.entry, [levels for _, levels in done if levels is not None]).decoded64()
            for target, delta in self.plan.shift_deltas(p, decoded):
                self.deltas[target] = self.deltas.get(target, 0.0) + delta
        self.payloads.add(p.entry, chunks)
        self.entries[p.name] = p.entry
        if self.decode:  # (a tensor coded losslessly: its values as given)
            out = self.outputs.pop(p.name, None)
            self._keep_decoded(p.entry, out if out is not None else np.array(p.values, dtype=p.entry.dtype.carrier))
        return p.entry.numel

    def _keep_decoded(self, e: TensorEntry, values: np.ndarray) -> None:
        """Keep ``values`` (an array of its own, the carrier's dtype) as the decoded values of ``e``."""
        self.decoded[e.name] = numpy_to_tensor(values.reshape(e.shape), e.dtype.dtype_name, bool(e.flags & FLAG_TORCH))

    def _store_coded(self, name: str, done: CodedTensor) -> None:
        """Store a tensor coded before (:func:`code_model`'s ``reuse``) as it was coded."""
        e = dataclasses.replace(done.entry, chunk_sizes=list(done.entry.chunk_sizes))
        if e.name != name:
            raise ValueError(f"internal error: {e.name!r} reused as {name!r}")
        self.payloads.add(e, done.chunks)
        self.entries[name] = e
        if self.decode:
            self.decoded[name] = done.decoded
        if self.progress is not None:
            self.progress(e.numel)

    def _store_raw(self, p: TensorPlan, counted: bool = False) -> None:
        e = p.entry
        flat = p.values.reshape(-1).astype(p.values.dtype.newbyteorder("<"), copy=False)
        e.chunk_elements = raw_chunk_elements(e.dtype)
        self.payloads.add(e, [flat[k:k + e.chunk_elements].tobytes() for k in range(0, flat.size, e.chunk_elements)])
        self.entries[e.name] = e
        if self.decode:  # (the values as given: exact)
            self._keep_decoded(e, np.array(p.values, dtype=e.dtype.carrier))
        if self.progress is not None and not counted:
            self.progress(flat.size)


def quantize_model(model: Mapping[str, Any] | Checkpoint, **settings: Any) -> dict[str, QuantizedTensor]:
    """The levels and steps :func:`encode_model` would code, without entropy coding.

    Parameters
    ----------
    model : mapping or Checkpoint
        As for :func:`encode_model`.
    **settings
        The settings of :func:`encode_model` (the fields of
        :class:`~deepcabac_py.model.settings.EncodeSettings`); TypeError for any other keyword.

    Returns
    -------
    dict of str to QuantizedTensor
        Every level-coded tensor; ``levels * step`` are the decoded values (for trellis tensors the
        levels are the reconstruction indices, not the transmitted ones). Tensors stored raw (kept
        exact, non-finite, complex) and optimizer moments (the log domain) are left out.
    """
    plan = plan_model(model, EncodeSettings(**settings))
    targets = plan.shift_targets
    out: dict[str, QuantizedTensor] = {}
    deltas: dict[str, Any] = {}
    for name in plan.names:
        if name in targets:
            continue
        p = plan.plan(name)
        if p.is_level_coded and p.entry.mode != Mode.LOG:
            out[name] = p.quantized()
            if name in plan.shift_layers:
                for target, delta in plan.shift_deltas(p, out[name].decoded64()):
                    deltas[target] = deltas.get(target, 0.0) + delta
    for name in targets:
        p = plan.with_shifts(name, deltas[name]) if name in deltas else plan.fixed[name]
        if p.is_level_coded and p.entry.mode != Mode.LOG:
            out[name] = p.quantized()
    return {n: out[n] for n in plan.names if n in out}
