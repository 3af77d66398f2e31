"""Whole-model encoding: plan, code, assemble.

:func:`encode_model` flattens any mapping of tensors (nested checkpoints included) and plans every
tensor (:mod:`.model_plan`: quantized floats, lossless integers, raw bytes). Every level-coded
tensor is cut into independent chunks, coded on a thread pool (the kernels release the GIL), and
the substreams are assembled behind the header (:mod:`.container`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..entropy import linear_prediction
from ..io.checkpoint import Checkpoint
from .container import raw_chunk_elements, write_header
from .levels import QuantizedTensor, assembled
from .model_plan import ModelPlan, plan_model
from .parallel import Progress, resolve_threads, run_largest_first
from .settings import DEFAULT_IMPORTANCE, DEFAULT_QP, DEFAULT_QP_DENSITY, DEFAULT_QUANTIZER, EncodeSettings
from .tensor_plan import TensorPlan

ChunkKey = tuple[str, int]  # (tensor name, chunk index)


def encode_model(
    model: Mapping[str, Any] | Checkpoint,
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
batchnorm_eps, bias_correction
        The settings of :class:`~deepcabac_py.model.settings.EncodeSettings`. In short: ``qp``
        sets the step of tensors with two or more dimensions (lower: finer, more bytes) and
        ``qp_1d`` that of biases and norms (default six octaves finer); ``quantizer`` is
        ``"trellis"`` (default), ``"rdoq"`` or ``"nearest"``; ``importance`` is
        ``"structural"`` (default: from the model itself, without data), a mapping of per-weight
        importances (e.g. :func:`deepcabac_py.tuning.fisher.diagonal_fisher`), or None.
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
    threads = resolve_threads(threads)
    settings = EncodeSettings(qp=qp, qp_density=qp_density, qp_1d=qp_1d, qp_overrides=qp_overrides,
                              keep_exact=keep_exact, quantizer=quantizer, lambda_scale=lambda_scale,
                              importance=importance, batchnorm_eps=batchnorm_eps, bias_correction=bias_correction)
    plan = plan_model(model, settings)
    plan, substreams = _code(plan, threads, progress)
    return _assemble(plan, substreams, settings, progress)


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
        exact, non-finite, complex) are left out.
    """
    plan = plan_model(model, EncodeSettings(**settings))
    out = {p.name: p.quantized() for p in plan.tensors if p.is_level_coded}
    if plan.shifts:
        plan = plan.take_out_shifts(lambda name: out[name].decoded64())
        out.update({p.name: p.quantized() for p in plan.tensors if p.name in plan.shift_targets})
    return out


def _code(plan: ModelPlan, threads: int, progress: Progress | None) -> tuple[ModelPlan, dict[ChunkKey, bytes]]:
    """Every chunk's substream, and the plan as coded (linear predictions attached, shift targets
    planned again). The layers whose shifts are taken out go first; their levels then say what the
    targets absorb."""
    targets, layers = plan.shift_targets, plan.shift_layers
    layer_levels: dict[ChunkKey, np.ndarray] = {}

    def run(job: tuple[TensorPlan, int]) -> bytes:
        p, k = job
        data, levels = p.encode_chunk(k)
        if p.name in layers:
            layer_levels[p.name, k] = levels
        if progress is not None:
            progress(p.chunks.size(k))
        return data

    def phase(plan: ModelPlan, in_targets: bool) -> tuple[ModelPlan, dict[ChunkKey, bytes]]:
        tensors = [p.with_linear_prediction() if (p.name in targets) == in_targets else p for p in plan.tensors]
        jobs = [(p, k) for p in tensors if p.is_level_coded and (p.name in targets) == in_targets
                for k in range(p.chunks.count)]
        with linear_prediction.blas_threads(any(p.linear is not None for p in tensors)):
            data = run_largest_first(jobs, lambda job: job[0].chunks.size(job[1]), run, threads)
        return dataclasses.replace(plan, tensors=tensors), {
            (p.name, k): d for (p, k), d in zip(jobs, data)}

    plan, substreams = phase(plan, False)
    if plan.shifts:
        by_name = {p.name: p for p in plan.tensors}

        def decoded(name: str) -> np.ndarray:
            p = by_name[name]
            return assembled(p.entry, [layer_levels[name, k] for k in range(p.chunks.count)]).decoded64()

        plan, more = phase(plan.take_out_shifts(decoded), True)
        substreams.update(more)
    return plan, substreams


def _assemble(plan: ModelPlan, substreams: Mapping[ChunkKey, bytes], settings: EncodeSettings,
              progress: Progress | None) -> bytes:
    """The header (every entry given its payload's place, sizes and checksum) and the payload."""
    payload: list[bytes] = []
    offset = 0
    for p in plan.tensors:
        e = p.entry
        if e.is_alias:
            continue
        if p.layout is None:
            flat = p.values.reshape(-1).astype(p.values.dtype.newbyteorder("<"), copy=False)
            e.chunk_elements = raw_chunk_elements(e.dtype)
            chunks = [flat[k:k + e.chunk_elements].tobytes() for k in range(0, flat.size, e.chunk_elements)]
            if progress is not None:
                progress(flat.size)
        else:
            chunks = [substreams[e.name, k] for k in range(p.layout.count)]
            if p.linear is not None:
                chunks.insert(0, p.linear.to_bytes())
        e.chunk_sizes = [len(c) for c in chunks]
        e.size = sum(e.chunk_sizes)
        e.offset = offset
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        e.crc32 = crc
        offset += e.size
        payload.extend(chunks)
    header = write_header(settings.qp, settings.qp_1d_resolved, settings.qp_density, plan.metadata,
                          [p.entry for p in plan.tensors])
    return b"".join([header, *payload])
