"""The checkpoints of a training run, each coded against the last.

The first entry and every ``key_every``-th are coded on their own (:func:`encode_model`); the
others as residuals: every float tensor that is not an optimizer moment or step is coded as its
difference from the previous entry *as decoded* (less what the optimizer's step directions predict
of it), and every second moment (Adam's ``exp_avg_sq``, which moves slowly: 0.999 per step) as
log2 of its ratio to the previous one as decoded; so the error of an entry is that of its own
quantization and does not accumulate along the chain.
Steps and everything else are coded as themselves. An entry whose tensors differ from its parent's (a new
parameter, a changed shape or dtype) is a key.

Adam's first moments are coded in the update domain, in keys and residuals alike: Adam's step is
m / (sqrt(v) + eps), so ``m`` is coded as ``u = m / ((sqrt(v) + eps) * r)`` with ``v`` the second
moment as this entry decodes it and ``r`` the root mean square of ``m / (sqrt(v) + eps)`` (a number
in the entry's meta), quantized like a weight at ``UPDATE_QP``. Every element then errs by the same
share of the step it makes; the log domain a plain encode uses spends as many bits on the moments
that barely move the step as on those that make it (the char-LSTM series of
``benchmarks/bench_series.py``: 7.1x -> 10.8x the raw files at the same next-step cosine, 0.995).
SGD's step is lr times its momentum buffer: the buffer is coded as ``u = m / r`` alike.

A lossless series (``keep_exact=True``) is bit-exact: there a float tensor's residual is taken on
its bits, as the difference of their order-preserving integer keys modulo 2**width (close values,
close keys: wide differences are coded by magnitude class) or as their XOR (coded as floats:
what did not change, sign and exponent, costs next to nothing), whichever of these and the tensor
itself (the lossless float coder) codes smallest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import CorruptStreamError, OutputError
from ..io.checkpoint import Checkpoint, flatten, numpy_to_tensor, tensor_to_numpy, unflatten
from ..io.directories import DIRECTORY_KIND, load_checkpoint_directory, save_checkpoint_directory
from ..io.dtypes import bfloat16_to_float32, float64_to_bfloat16
from ..io.files import load_checkpoint, save_checkpoint
from ..io.kinds import kind_from_suffix
from ..model.decoder import decode_checkpoint, read_stream_header
from ..model.encoder import CodedModel, CodedTensor, code_model, encode_model
from ..model.optimizer_state import (
    FIRST_MOMENT,
    SECOND_MOMENT,
    AdamGroup,
    MomentumGroup,
    adam_groups,
    first_moments,
    momentum_groups,
    roles,
)
from ..model.settings import DEFAULT_MOMENTS_QP, EncodeSettings, is_glob, lookup_qp, matches
from ..quant import portable
from ..quant.steps import qp_at_most
from . import _series_kernels as _k
from . import carried_files
from .records import SeriesFile

__all__ = ["CheckpointSeries", "SeriesEntry", "DEFAULT_KEY_EVERY", "DEFAULT_SERIES_QP"]

DEFAULT_KEY_EVERY = 10
# The weights' finest qp in a lossy series unless one is given: an entry is kept to be resumed from,
# so its weights stay about as close as a bfloat16 copy of them (a step of 2**-13). On the runs of
# benchmarks/bench_series.py, encode's default (-32) moves the digits CNN's held-out loss by up to
# 12% and turns its next Adam step by a cosine of 0.91; -52 moves it by 0.2% at a cosine of 0.995.
DEFAULT_SERIES_QP = -52
# qp of a first moment in the update domain (``u`` has a root mean square of 1)
UPDATE_QP = -11
UPDATE_SUFFIX = "~update"  # the coded name of a first moment in the update domain (no role matches it)
# A residual entry's second moment is coded as log2 of its ratio to the parent's, a float centred on
# 0 quantized like a weight, at this many qp below ``moments_qp`` (the log domain of a key codes
# levels counted from the smallest magnitude: about 3 bits per element for ratios near 1 where
# their log costs 1.5)
LOG_RATIO_SUFFIX = "~log2ratio"
LOG_RATIO_QP_OFFSET = -4
ADAM_EPS = 1e-8  # (torch's default; where sqrt(v) is far above it, as it is wherever m matters, it is moot)
KEY, RESIDUAL = "key", "residual"
_FLOATS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class SeriesEntry:
    """One entry as ``list`` shows it."""

    index: int
    kind: str  # "key" or "residual"
    step: int | None
    bytes: int
    parent: int | None


class CheckpointSeries:
    """A checkpoint series file (``.dcs``): ``append(obj)``, ``len(series)``, ``series[i]``.

    Parameters
    ----------
    path : str or PathLike
        The series file (created by the first ``append``).
    key_every : int
        Every this-many-th entry is coded on its own (a chain of residuals is never longer).
    **settings
        Settings of :func:`~deepcabac_py.model.encoder.encode_model` for every entry. ``qp`` given
        is the step of every weight and residual; by default a weight with Adam or SGD state is
        coded at the size of its optimizer's last step on its tensor, never finer than
        ``DEFAULT_SERIES_QP`` (:data:`STEP_FRACTION`).
    """

    def __init__(self, path: str | os.PathLike, *, key_every: int = DEFAULT_KEY_EVERY, **settings: Any):
        if isinstance(key_every, bool) or not isinstance(key_every, int) or key_every < 1:
            raise ValueError(f"key_every must be a positive integer, got {key_every!r}")
        self.path = os.fspath(path)
        self.key_every = key_every
        self.settings = settings if settings.get("keep_exact") is True else {"qp": DEFAULT_SERIES_QP, **settings}
        self._steps_from_optimizer = "qp" not in settings  # (a qp given is the step of every weight)
        self._last: tuple[int, Checkpoint] | None = None  # the newest entry as decoded
        self._key: tuple[int, dict[str, int]] | None = None  # the newest key's index and qps

    def _records(self):
        if not os.path.exists(self.path):
            return []
        with SeriesFile(self.path) as f:
            return list(f.records)

    def __len__(self) -> int:
        return len(self._records())

    def entries(self) -> list[SeriesEntry]:
        """Index, kind, step (when the checkpoint has one), bytes and parent of every entry."""
        return [SeriesEntry(r.index, r.meta.get("kind", "?"), r.meta.get("step"), r.payload_size, r.meta.get("parent"))
                for r in self._records()]

    def append(self, obj: Any) -> int:
        """Add a checkpoint at the end: any object :func:`encode_model` takes, or the path of a
        checkpoint file or directory (a Trainer's ``checkpoint-N/``: every file, see
        :func:`~deepcabac_py.io.directories.load_checkpoint_directory`). Returns its index. Atomic:
        a crash leaves the series as it was; another writer at the same time is refused."""
        if isinstance(obj, (str, os.PathLike)):
            obj = load_checkpoint_directory(obj) if os.path.isdir(obj) else load_checkpoint(obj)
        ckpt = obj if isinstance(obj, Checkpoint) else flatten(obj)
        with SeriesFile(self.path, writer=True) as f:
            index = len(f.records)
            parent = self._decoded(f, index - 1) if index % self.key_every else None
            if parent is not None and not _same_tensors(parent, ckpt):
                parent = None
            meta: dict[str, Any] = {"kind": KEY if parent is None else RESIDUAL,
                                    "parent": None if parent is None else index - 1, "step": _step_of(ckpt)}
            # (a key after the first pairs its weights by the entry before too, where this object
            # holds it: the pairs then do not depend on the order the checkpoint lists its tensors in)
            previous = parent
            if previous is None and self._last is not None and self._last[0] == index - 1 \
                    and _same_tensors(self._last[1], ckpt):
                previous = self._last[1]
            pairing = _weight_pairs(ckpt, previous)
            work = _Work()
            if parent is None:
                settings = dict(self.settings)
                coded = ckpt
                if self.settings.get("keep_exact") is not True:
                    stepped = _step_qps(ckpt, self.settings, pairing) if self._steps_from_optimizer else {}
                    coarser = {n: qp for n, (qp, base) in stepped.items() if qp > base}
                    coded, meta["update_domain"], overrides, _ = _in_update_domain(ckpt, settings, coarser, [], None,
                                                                                   work)
                    settings["qp_overrides"] = {**overrides, **(self.settings.get("qp_overrides") or {})}
                result = _coded(coded, settings, work.tensors)
                self._key = (index, _quantized_qps(result.data))
                residuals: list[str] = []
            elif self.settings.get("keep_exact") is True:
                coded, keyed, xored, meta["bit_predicted"] = _bit_residual_checkpoint(ckpt, parent, pairing.pairs)
                meta["bit_residuals"], meta["xor_residuals"] = keyed, xored
                residuals = []
                result = _coded(_carried_against(coded, parent, meta), self.settings, work.tensors)
            else:
                coded, residuals, log_ratios = _residual_checkpoint(ckpt, parent)
                meta["log_ratios"] = log_ratios
                # A residual is not a model (no importance from its own structure, no BatchNorm
                # shifts): each residual gets the qp its tensor got in the key, where the model's
                # structure chose it (finer where errors cost more).
                key_qps = self._key_qps(f, index)
                settings = {"importance": None, "bias_correction": False, **self.settings}
                log_ratio_qp = settings.get("moments_qp", DEFAULT_MOMENTS_QP) + LOG_RATIO_QP_OFFSET
                # (a weight whose key took its optimizer's step size takes its own now, or the series' qp:
                # training may have slowed since the key)
                stepped = _step_qps(ckpt, self.settings, pairing) if self._steps_from_optimizer else {}
                overrides = {**{n: key_qps[n] for n in residuals if n in key_qps},
                             **{n: qp if qp > base else min(key_qps.get(n, base), base)
                                for n, (qp, base) in stepped.items() if n in residuals},
                             **{n + LOG_RATIO_SUFFIX: log_ratio_qp for n in log_ratios}}
                coded, meta["update_domain"], overrides, seconds = _in_update_domain(coded, settings, overrides,
                                                                                     log_ratios, parent, work)
                coded, meta["predicted"], meta["v_scaled"] = _predicted_residuals(
                    coded, residuals, settings, overrides, meta["update_domain"], seconds, parent, pairing.pairs, work)
                settings["qp_overrides"] = {**overrides, **(self.settings.get("qp_overrides") or {})}
                result = _coded(_carried_against(coded, parent, meta), settings, work.tensors)
            meta["residuals"] = residuals
            f.append(meta, result.data)
            # (the entry as a reader will decode it, from the levels as they were coded)
            self._last = (index, _reconstruct(f.path, index, result.decoded, meta, parent, work.restored))
        return index

    def _key_qps(self, f: SeriesFile, index: int) -> dict[str, int]:
        """The qp of every quantized tensor of the key that entry ``index`` descends from (read
        from the file only by an object that did not append that key itself)."""
        i = index - 1
        while i > 0 and f.records[i].meta.get("kind") != KEY:
            i -= 1
        if self._key is None or self._key[0] != i:
            self._key = (i, _quantized_qps(f.payload(f.records[i])))
        return self._key[1]

    def __getitem__(self, index: int) -> Any:
        """Entry ``index`` decoded (the chain from its key verified on the way)."""
        return unflatten(self.checkpoint(index))

    def checkpoint(self, index: int) -> Checkpoint:
        """Entry ``index`` as a :class:`Checkpoint` (flat tensors and structure)."""
        with SeriesFile(self.path) as f:
            count = len(f.records)
            if isinstance(index, bool) or not isinstance(index, int):
                raise TypeError(f"series indices are integers, got {index!r}")
            if index < 0:
                index += count
            if not 0 <= index < count:
                raise IndexError(f"{self.path}: no entry {index} (the series has {count})")
            return self._decoded(f, index)

    def extract(self, index: int, path: str | os.PathLike, *, force: bool = False) -> None:
        """Write entry ``index`` to ``path``: a directory where the entry was one, else a checkpoint
        file of the kind its suffix says (``.pt`` without one). Atomic; ``force`` replaces an
        existing output."""
        ckpt = self.checkpoint(index)
        if ckpt.kind == DIRECTORY_KIND:
            if kind_from_suffix(path) is not None:
                raise OutputError(f"entry {index} is a directory; {os.fspath(path)} names a checkpoint file")
            save_checkpoint_directory(ckpt, path, force=force)
        else:
            save_checkpoint(ckpt, path, kind=kind_from_suffix(path) or "torch", force=force)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def _decoded(self, f: SeriesFile, index: int) -> Checkpoint:
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        # back to the key, then forward through the residuals
        chain = [index]
        while True:
            meta = f.records[chain[-1]].meta
            if meta.get("kind") == KEY:
                break
            parent = meta.get("parent")
            if meta.get("kind") != RESIDUAL or parent != chain[-1] - 1:
                raise CorruptStreamError(f"{f.path}: entry {chain[-1]} has no valid parent")
            chain.append(parent)
        ckpt: Checkpoint | None = None
        for i in reversed(chain):
            record = f.records[i]
            ckpt = _reconstruct(f.path, i, decode_checkpoint(f.payload(record)), record.meta, ckpt)
        if ckpt is None:
            raise RuntimeError("internal error: an empty chain")
        return ckpt


@dataclass
class _Work:
    """What an append has made on the way to its entry: tensors coded alone (their values were
    needed first; the entry takes them as they were coded) and moments as a reader restores them
    (the writer's reconstruction of the entry takes them instead of restoring them again)."""

    tensors: dict[str, CodedTensor] = field(default_factory=dict)
    restored: dict[str, Any] = field(default_factory=dict)


def _reconstruct(path: str, index: int, decoded: Checkpoint, meta: dict, parent: Checkpoint | None,
                 restored: Mapping[str, Any] | None = None) -> Checkpoint:
    """Entry ``index`` from its stream as decoded (``decoded``), its meta and its parent
    (``restored``: moments the writer has restored already, by name)."""
    restored = restored or {}
    where = f"{path}: entry {index}"
    if meta.get("kind") == KEY:
        return _with_tensors(decoded, _from_update_domain(where, decoded.tensors, meta.get("update_domain", {}),
                                                          restored))
    if parent is None:
        raise CorruptStreamError(f"{path}: entry {index} is a residual without its parent")
    if "carried" in meta:
        decoded = replace(decoded, skeleton=carried_files.restored(where, decoded.skeleton, meta["carried"],
                                                                   parent.skeleton))
    residuals, ratios = _names(meta.get("residuals")), _names(meta.get("ratios", []))
    keyed, xored = _names(meta.get("bit_residuals", [])), _names(meta.get("xor_residuals", []))
    log_ratios = _names(meta.get("log_ratios", []))
    if (residuals is None or ratios is None or keyed is None or xored is None or log_ratios is None
            or not set(residuals + ratios + keyed + xored + [n + LOG_RATIO_SUFFIX for n in log_ratios])
            <= set(decoded.tensors)):
        raise CorruptStreamError(f"{path}: entry {index} lists residuals it does not hold")
    tensors = _from_log_ratios(where, decoded.tensors, log_ratios, parent, restored)
    # (the moments' roles by the entry's structure, a state dict keyed by parameter names too: the
    # names each tensor has once the update domain is undone)
    moment_roles = roles([n.removesuffix(UPDATE_SUFFIX) for n in tensors], decoded.skeleton)
    bit_predicted = _predictions(where, meta.get("bit_predicted", {}),
                                 [n for n in decoded.tensors if n not in keyed + xored], tensors, moment_roles)
    for name in keyed + xored + list(bit_predicted):  # (predicted last: from the moments as restored)
        if name not in parent.tensors:
            raise CorruptStreamError(f"{path}: entry {index}: residual {name!r} has no parent tensor")
        base, dtype, is_torch = tensor_to_numpy(parent.tensors[name])
        delta, delta_dtype, _ = tensor_to_numpy(tensors[name])
        words = _WORDS.get(dtype)
        if (words is None or delta.shape != base.shape
                or delta_dtype != (dtype if name in xored else _DELTAS.get(dtype))):
            raise CorruptStreamError(f"{path}: entry {index}: bit residual {name!r} does not match its parent")
        if name in bit_predicted:
            moment, coefs = bit_predicted[name]
            base = _predicted_bits(base, dtype, _prediction(tensors, parent.tensors, moment, coefs))
        theirs = np.require(base, requirements="C").view(words)
        if name in keyed or name in bit_predicted:
            bits = _from_order_key(np.asarray(_order_key(theirs) + delta.view(words)))  # (modulo 2**width)
        else:
            bits = theirs ^ np.require(delta, requirements="C").view(words)
        tensors[name] = numpy_to_tensor(np.asarray(bits).view(base.dtype).reshape(base.shape), dtype, is_torch)
    for name in ratios:
        tensors[name] = _applied(where, name, tensors[name], parent.tensors.get(name), RATIO)
    # the moments first: a residual may be predicted from the step they make
    tensors = _from_update_domain(where, tensors, meta.get("update_domain", {}), restored)
    predicted = _predictions(where, meta.get("predicted", {}), residuals, tensors, moment_roles)
    scaled = _scalings(where, meta.get("v_scaled", {}), list(predicted), tensors, moment_roles)
    for name in residuals:
        guess = scale = None
        if name in predicted:
            moment, coefs = predicted[name]
            guess = (*_prediction_moments(tensors, parent.tensors, moment), coefs)
        if name in scaled:
            second, mean = scaled[name]
            v, dv, _ = tensor_to_numpy(tensors[second])
            scale = (v, dv, mean)
        tensors[name] = _applied(where, name, tensors[name], parent.tensors.get(name), RESIDUAL, guess, scale)
    return _with_tensors(decoded, tensors)


def _carried_against(coded: Checkpoint, parent: Checkpoint, meta: dict[str, Any]) -> Checkpoint:
    """A directory entry with the files it carries as bytes cut to what differs from its parent's
    (named in the meta's ``carried``)."""
    if coded.kind != DIRECTORY_KIND or parent.kind != DIRECTORY_KIND:
        return coded
    skeleton, refs = carried_files.referenced(coded.skeleton, parent.skeleton)
    if not refs:
        return coded
    meta["carried"] = refs
    return replace(coded, skeleton=skeleton)


def _direction_inputs(tensors: dict[str, Any], moment: str) -> _Moments:
    """An entry's decoded first moment ``moment`` and the second moment its step divides it by, as
    the kernels read them (:func:`_flat`; None for SGD's momentum buffer, its own direction), and
    its shape; checked."""
    m, dm, _ = tensor_to_numpy(tensors[moment])
    if _is_momentum_buffer(moment):
        return _flat(m, dm), None, m.shape
    partner = _partner_of(moment, tensors)
    if partner is None:
        raise CorruptStreamError(f"first moment {moment!r} has no second moment")
    v, dv, _ = tensor_to_numpy(tensors[partner])
    if m.shape != v.shape:
        raise CorruptStreamError(f"first moment {moment!r} does not match its second moment")
    return _flat(m, dm), _flat(v, dv), m.shape


def _direction(tensors: dict[str, Any], moment: str) -> np.ndarray:
    """The direction of the optimizer's step of an entry's decoded first moment ``moment``
    (float64): m / (sqrt(v) + eps) for Adam's, SGD's momentum buffer itself."""
    return _direction_of(*_direction_inputs(tensors, moment))


def _direction_of(m: np.ndarray, v: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """:func:`_direction` of what :func:`_direction_inputs` gives."""
    if v is None:
        return m.astype(np.float64).reshape(shape)
    out = np.empty(m.size, dtype=np.float64)
    _k.direction_into(m, v, ADAM_EPS, out)
    return out.reshape(shape)


_Moments = tuple[np.ndarray, "np.ndarray | None", tuple[int, ...]]  # (what _direction_inputs gives)


def _prediction_moments(tensors: dict[str, Any], parent: dict[str, Any], moment: str) -> tuple[_Moments, _Moments]:
    """What a prediction from first moment ``moment`` reads: the entry's and the parent's moments
    (:func:`_direction_inputs`), checked."""
    if moment not in parent:
        raise CorruptStreamError(f"prediction from {moment!r}, which the parent does not hold")
    return _direction_inputs(tensors, moment), _direction_inputs(parent, moment)


def _prediction(tensors: dict[str, Any], parent: dict[str, Any], moment: str, coefs: tuple[float, float]) -> np.ndarray:
    """A weight's change since the parent as its entry's and its parent's step directions of first
    moment ``moment`` predict it (the optimizer's steps in between went from the one to the other)."""
    now, before = _prediction_moments(tensors, parent, moment)
    return _combined(coefs, _direction_of(*now), _direction_of(*before))


def _combined(coefs: tuple[float, float], now: np.ndarray, before: np.ndarray) -> np.ndarray:
    """The prediction of coefficients ``coefs`` on the two directions (the reader's arithmetic)."""
    return coefs[0] * now + coefs[1] * before


def _fitted_prediction(change: np.ndarray, tensors: dict[str, Any], parent: dict[str, Any],
                       moment: str) -> tuple[tuple[float, float], np.ndarray, np.ndarray] | None:
    """The writer's side of :func:`_prediction`: the coefficients of ``change`` on the entry's and
    the parent's directions of ``moment``, and those directions (each computed once), None where
    the coefficients do not hold."""
    now, before = _direction(tensors, moment), _direction(parent, moment)
    coefs = _fitted(change, now, before)
    return None if coefs is None else (coefs, now, before)


def _fitted(change: np.ndarray, now: np.ndarray, before: np.ndarray) -> tuple[float, float] | None:
    """Least-squares coefficients of ``change`` on two directions, None where they do not hold. (The
    sums and the 2 x 2 solve in an order no processor changes: the coefficients are written.)"""
    a, b, d = now.ravel(), before.ravel(), change.ravel()
    aa, ab, bb = portable.dot(a, a), portable.dot(a, b), portable.dot(b, b)
    ad, bd = portable.dot(a, d), portable.dot(b, d)
    det = aa * bb - ab * ab  # (Python floats: an overflow is inf, never an exception)
    if not all(math.isfinite(g) for g in (aa, ab, bb, det)) or abs(det) <= 1e-12 * max(aa * bb, 1e-300):
        return None
    c = ((ad * bb - ab * bd) / det, (aa * bd - ab * ad) / det)
    return c if all(math.isfinite(x) for x in c) else None


def _predictions(where: str, listed: Any, residuals: list[str], tensors: dict[str, Any],
                 moment_roles: dict[str, str]) -> dict[str, tuple[str, tuple[float, float]]]:
    """The meta's ``predicted``, checked: residual name -> (first moment, coefficients)."""
    refs = _moment_references(where, listed, residuals, tensors, moment_roles, role=FIRST_MOMENT, what="prediction",
                              numbers=lambda xs: len(xs) == 2 and all(type(c) is float and np.isfinite(c) for c in xs))
    return {name: (moment, (xs[0], xs[1])) for name, (moment, xs) in refs.items()}


def _scalings(where: str, listed: Any, predicted: list[str], tensors: dict[str, Any],
              moment_roles: dict[str, str]) -> dict[str, tuple[str, float]]:
    """The meta's ``v_scaled``, checked: predicted residual name -> (second moment, its mean)."""
    refs = _moment_references(where, listed, predicted, tensors, moment_roles, role=SECOND_MOMENT,
                              what="residual scale",
                              numbers=lambda xs: len(xs) == 1 and type(xs[0]) is float and np.isfinite(xs[0])
                              and xs[0] > 0)
    return {name: (moment, xs[0]) for name, (moment, xs) in refs.items()}


def _moment_references(where: str, listed: Any, names: list[str], tensors: dict[str, Any], moment_roles: dict[str, str],
                       *, role: str, what: str, numbers: Callable[[list], bool]) -> dict[str, tuple[str, list]]:
    """A meta object from tensor names in ``names`` to ``[moment, numbers...]``, checked: each
    moment of ``role`` (by ``moment_roles``: :func:`roles` of the entry) held by the entry with its
    tensor's shape, the numbers as ``numbers`` takes them (``what`` names one in the errors); name
    -> (moment, numbers)."""
    if not isinstance(listed, dict):
        raise CorruptStreamError(f"{where}: malformed {what}s")
    out = {}
    for name, value in listed.items():
        if not isinstance(value, list) or not value or not isinstance(value[0], str) or not numbers(value[1:]):
            raise CorruptStreamError(f"{where}: malformed {what} of {name!r}")
        moment = value[0]
        if name not in names or moment_roles.get(moment) != role or moment not in tensors:
            raise CorruptStreamError(f"{where}: {what} of {name!r} names what the entry does not hold")
        if tensor_to_numpy(tensors[moment])[0].shape != tensor_to_numpy(tensors[name])[0].shape:
            kind = "first" if role == FIRST_MOMENT else "second"
            raise CorruptStreamError(f"{where}: {what} of {name!r} does not match its {kind} moment")
        out[name] = (moment, value[1:])
    return out


RATIO, LOG_RATIO = "ratio", "log2 ratio"


def _applied(where: str, name: str, change: Any, parent: Any, kind: str,
             guess: tuple[_Moments, _Moments, tuple[float, float]] | None = None,
             scale: tuple[np.ndarray, str, float] | None = None) -> Any:
    """The tensor ``name`` of an entry from its parent's and its decoded change: a ``RESIDUAL``
    (divided by its second moment's scale if ``scale``, (that moment, its dtype, its mean), is
    given: see :func:`._series_kernels.residual_scale`; then added, with its prediction if
    ``guess`` is given: :func:`_prediction_moments` and the coefficients), a ``RATIO``
    (multiplied; written before log2 ratios were) or a ``LOG_RATIO``."""
    if parent is None:
        raise CorruptStreamError(f"{where}: residual {name!r} has no parent tensor")
    base, dtype, is_torch = tensor_to_numpy(parent)
    delta, delta_dtype, _ = tensor_to_numpy(change)
    if delta.shape != base.shape:
        raise CorruptStreamError(f"{where}: residual {name!r} does not match its parent")
    if kind == RATIO:
        value = base * delta.astype(np.float64)
        return numpy_to_tensor(_to_carrier(value, dtype), dtype, is_torch)
    out = _output(base.size, dtype)
    if kind == LOG_RATIO:
        _k.ratio_applied_into(_flat(base, dtype), _flat(delta, delta_dtype), out)
    else:
        # (the kernel takes arrays for what it does not read: ``out`` stands in)
        second, mean = (_flat(scale[0], scale[1]), scale[2]) if scale is not None else (out, 1.0)
        (m, mv, _), (pm, pv, _), (c0, c1) = guess if guess is not None else ((out, None, ()), (out, None, ()),
                                                                             (0.0, 0.0))
        adam = mv is not None and pv is not None
        mv, pv = (mv, pv) if mv is not None and pv is not None else (out, out)
        if any(a.size != base.size for a in (second, m, pm, mv, pv)):
            raise CorruptStreamError(f"{where}: the moments of {name!r} do not match it")
        _k.residual_applied_into(_flat(base, dtype), _flat(delta, delta_dtype), second, mean, RESIDUAL_SCALE_FLOOR,
                                 scale is not None, m, mv, pm, pv, c0, c1, ADAM_EPS, guess is not None, adam, out)
    return numpy_to_tensor(_carrier(out, dtype).reshape(base.shape), dtype, is_torch)


def _from_log_ratios(where: str, tensors: dict[str, Any], names: list[str], parent: Checkpoint,
                     restored: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The decoded tensors with each second moment coded as a log2 ratio back as itself, in its
    place (those of ``restored`` as they are there)."""
    if not names:
        return dict(tensors)
    restored = restored or {}
    coded = {n + LOG_RATIO_SUFFIX: n for n in names}

    def back(k: str, t: Any) -> Any:
        name = coded[k]
        return restored[name] if name in restored else _applied(where, name, t, parent.tensors.get(name), LOG_RATIO)

    return {coded.get(k, k): back(k, t) if k in coded else t for k, t in tensors.items()}


def _update_partners(tensors: dict[str, Any], skeleton: Any) -> dict[str, str | None]:
    """First moment -> the second moment its Adam step divides it by (``max_exp_avg_sq`` under
    amsgrad, else ``exp_avg_sq``), or None for SGD's momentum buffer (its step is lr times the
    buffer), for the first moments the update domain takes: float32/float64, one shape."""
    pairs: dict[str, str | None] = {}
    state = roles(tensors, skeleton)
    for name, t in tensors.items():
        if state.get(name) != FIRST_MOMENT:
            continue
        m, dm, _ = tensor_to_numpy(t)
        if dm not in ("float32", "float64") or not m.size:
            continue
        if _is_momentum_buffer(name):
            pairs[name] = None
            continue
        partner = _partner_of(name, tensors)
        if partner is None:
            continue
        v, dv, _ = tensor_to_numpy(tensors[partner])
        if dv in ("float32", "float64") and m.shape == v.shape:
            pairs[name] = partner
    return pairs


def _is_momentum_buffer(first_moment: str) -> bool:
    """Whether a first moment (by its role: a name alone does not say) is SGD's momentum buffer."""
    return first_moment.endswith("momentum_buffer")


def _partner_of(name: str, tensors: dict[str, Any]) -> str | None:
    """The second moment of Adam's first moment ``name`` among ``tensors`` (None for anything else)."""
    if not name.endswith("exp_avg"):
        return None
    stem = name[:-len("exp_avg")]
    return next((stem + p for p in ("max_exp_avg_sq", "exp_avg_sq") if stem + p in tensors), None)


def _in_update_domain(coded: Checkpoint, settings: dict[str, Any], overrides: dict[str, int], log_ratios: list[str],
                      parent: Checkpoint | None, work: _Work
                      ) -> tuple[Checkpoint, dict[str, float], dict[str, int], dict[str, Any]]:
    """``coded`` (an entry as it will be coded) with its first moments in the update domain, their
    ``r`` by name, the qp overrides with theirs, and the second moments they are divided by as the
    entry decodes them: coded alone with the entry's settings (each is quantized on its own,
    without importance: the same levels; into ``work``), their log2 ratios applied to the parent's
    (restored: into ``work`` too)."""
    # (a second moment coded as a log2 ratio has its moment's shape and dtype)
    partners = _update_partners({**coded.tensors, **{n: coded.tensors[n + LOG_RATIO_SUFFIX] for n in log_ratios}},
                                coded.skeleton)
    if not partners:
        return coded, {}, overrides, {}
    names = sorted({p for p in partners.values() if p is not None})
    sources = sorted(n + LOG_RATIO_SUFFIX if n in log_ratios else n for n in names)
    decoded = _decoded_alone(coded, sources, settings, overrides, work.tensors) if sources else {}
    if log_ratios:
        if parent is None:
            raise RuntimeError("internal error: log2 ratios without a parent")
        decoded = _from_log_ratios("a second moment", decoded, [n for n in names if n in log_ratios], parent)
    seconds = {n: decoded[n] for n in names}
    work.restored.update(seconds)
    second = {n: _flat(*tensor_to_numpy(t)[:2]) for n, t in seconds.items()}
    tensors: dict[str, Any] = {}
    scales: dict[str, float] = {}
    overrides = dict(overrides)
    for name, t in coded.tensors.items():
        if name in partners:
            m, dtype, is_torch = tensor_to_numpy(t)
            partner = partners[name]
            if partner is None:
                u = m.astype(np.float64)
            else:
                u = np.empty(m.size, dtype=np.float64)
                _k.direction_into(_flat(m, dtype), second[partner], ADAM_EPS, u)
            with np.errstate(over="ignore", invalid="ignore"):
                r = float(np.sqrt(np.mean(u * u)))
            if np.isfinite(r) and r > 0:
                out = np.empty(m.size, dtype=dtype)  # (float32 or float64: _update_partners)
                if _k.divided_into(u.reshape(-1), r, out):
                    tensors[name + UPDATE_SUFFIX] = numpy_to_tensor(out.reshape(m.shape), dtype, is_torch)
                    scales[name] = r
                    overrides[name + UPDATE_SUFFIX] = UPDATE_QP
                    continue
        tensors[name] = t
    return _with_tensors(coded, tensors), scales, overrides, seconds


# A predicted residual is coded in units that follow its weight's second moment v, which estimates
# the loss's curvature along the weight (Adam's v is the mean squared gradient: a Fisher estimate):
# times sqrt(v / mean v), so that where v is small a weight is rounded more coarsely, at most
# RESIDUAL_SCALE_FLOOR times the step. The loss grows by about what one step for all would add (the
# sum of v times the squared error is the same), for fewer bits. bench_series.py, one run each: the
# char-LSTM series 8.0% smaller at the same fidelity; the digits CNN's 1.0% smaller, its smallest
# next-step cosine 0.9962 -> 0.9931 (Adam divides the next step by sqrt(v), so the weights where v
# is small weigh more in it than in the loss).
# (:func:`._series_kernels.residual_scale`)
RESIDUAL_SCALE_FLOOR = 1 / 16


# A weight's residual is predicted from its step direction (:func:`_direction`) only where that takes
# this share of its energy at least (a pairing that does not hold costs a number and nothing more)
MIN_PREDICTION_GAIN = 0.05


def _predicted_residuals(coded: Checkpoint, residuals: list[str], settings: dict[str, Any], overrides: dict[str, int],
                         scales: dict[str, float], seconds: dict[str, Any], parent: Checkpoint,
                         pairs: dict[str, str], work: _Work
                         ) -> tuple[Checkpoint, dict[str, list], dict[str, list]]:
    """``coded`` with each weight's residual less its prediction from the step directions of its
    first moment (:func:`_direction`), as the entry decodes it and as the parent did (the steps
    since the parent follow the moments: for the char-LSTM of bench_series their correlation is
    0.7-0.9), the two coefficients fitted by least squares, and then in its second moment's scale
    (:func:`._series_kernels.residual_scale`; Adam's only); the meta's ``predicted``: weight -> [first moment, c_entry,
    c_parent], and ``v_scaled``: weight -> [second moment, its mean]. ``scales`` are the first
    moments' in the update domain and ``seconds`` the second moments as :func:`_in_update_domain`
    decoded them; ``pairs`` pair weights with first moments (:func:`_weight_pairs`); the first
    moments as coded and as restored go into ``work``."""
    firsts = _in_optimizer_order(scales, coded.skeleton)
    if not firsts or not residuals:
        return coded, {}, {}
    # the first moments as the entry decodes them (quantized on their own: the same levels)
    sources = sorted(m + UPDATE_SUFFIX for m in firsts)
    decoded = _decoded_alone(coded, sources, settings, overrides, work.tensors)
    decoded = _from_update_domain("a first moment", {**seconds, **decoded}, scales)
    work.restored.update({m: decoded[m] for m in firsts})
    tensors = dict(coded.tensors)
    predicted: dict[str, list] = {}
    v_scaled: dict[str, list] = {}
    exact = _exact_patterns(settings)
    wanted = set(residuals)
    for name, moment in ((w, m) for w, m in pairs.items() if w in wanted and m in scales):
        delta, dtype, is_torch = tensor_to_numpy(coded.tensors[name])
        if matches(name, exact):  # (kept as its residual is: a prediction would round it)
            continue
        d = delta.astype(np.float64).reshape(-1)
        fit = _fitted_prediction(d, decoded, parent.tensors, moment)
        if fit is None:
            continue
        coefs, now, before = fit
        rest = np.empty(d.size, dtype=np.float64)
        _k.rest_into(d, now.reshape(-1), before.reshape(-1), coefs[0], coefs[1], rest)
        if not np.all(np.isfinite(rest)) or np.vdot(rest, rest) > (1 - MIN_PREDICTION_GAIN) * np.vdot(d, d):
            continue
        out = np.empty(d.size, dtype=dtype)  # (a residual is float32 or float64: _residual_checkpoint)
        # (a first moment in the update domain has a second moment of its shape)
        second = _partner_of(moment, decoded)
        v = _flat(*tensor_to_numpy(decoded[second])[:2]) if second is not None else None
        mean = float(np.mean(np.abs(v.astype(np.float64)))) if v is not None else 0.0
        if v is not None and np.isfinite(mean) and mean > 0:
            _k.scaled_by_moment_into(rest, v, mean, RESIDUAL_SCALE_FLOOR, out)
            v_scaled[name] = [second, mean]
        else:
            out[:] = rest
        tensors[name] = numpy_to_tensor(out.reshape(delta.shape), dtype, is_torch)
        predicted[name] = [moment, *coefs]
    return _with_tensors(coded, tensors), predicted, v_scaled


# A weight's error is judged against the steps its training takes: Adam moves every weight by about
# lr * m-hat / sqrt(v-hat) at each step, SGD with momentum by lr times its buffer (the root mean
# square of either over a tensor is the tensor's step size), and an error of that size is what one
# more step of noisy training does. So a weight with an optimizer's state is coded at STEP_FRACTION
# times that size where this is coarser than the series' qp: coarse where training still moves
# fast, at the series' qp where it has settled. On the checkpoints of bench_series.py: the
# char-LSTM series 15% smaller at the same next-step cosine, the digits CNN's 1.6%; at twice the
# size the char-LSTM's 22%, but the digits CNN's held-out loss then moved by 0.77% at one
# checkpoint (0.26% at once the size; the fidelity goal is 0.5%).
STEP_FRACTION = 1.0


def _step_qps(ckpt: Checkpoint, settings: dict[str, Any], pairing: _Pairing) -> dict[str, tuple[int, int]]:
    """Weight -> (its qp by the size of the optimizer's last step on it, ``settings``' qp for it:
    ``qp``, or ``qp_1d`` for at most one dimension), for the weights of ``ckpt`` whose Adam or SGD
    state (moments and param group) it holds, paired with their first moments by ``pairing``
    (:func:`_weight_pairs`), and no qp override of ``settings`` names (those win).

    A weight left unpaired (the first key of a checkpoint that lists its weights in another order
    than its optimizer numbers them: a safetensors file sorts them by name) takes the smallest
    step of the unpaired first moments of its shape, where the shape has no more unpaired weights
    than those moments (so that no buffer, BatchNorm's running statistics say, can be among them):
    finer than its own step, whichever moment that is."""
    groups: dict[str, AdamGroup | MomentumGroup] = {**adam_groups(ckpt.skeleton), **momentum_groups(ckpt.skeleton)}
    given = settings.get("qp_overrides") or {}
    series = EncodeSettings(**{k: settings[k] for k in ("qp", "qp_density", "qp_1d") if k in settings})
    pairs = pairing.pairs
    sizes = {name: _step_size(ckpt.tensors, moment, groups[moment]) if moment in groups else None
             for name, moment in pairs.items()}
    taken = set(pairs.values())
    spare = _by_shape([w for w in pairing.weights if w not in pairs], [m for m in pairing.firsts if m not in taken],
                      ckpt.tensors)
    for ws, ms in spare.values():
        steps = [_step_size(ckpt.tensors, m, groups[m]) if m in groups else None for m in ms]
        if ws and len(ws) <= len(ms) and None not in steps:
            sizes.update(dict.fromkeys(ws, min(s for s in steps if s is not None)))
    qps = {}
    for name, size in sizes.items():
        if size is None or lookup_qp(name, given) is not None:
            continue
        try:
            qp = qp_at_most(STEP_FRACTION * size, series.qp_density)
        except ValueError:
            continue
        qps[name] = (qp, series.qp if tensor_to_numpy(ckpt.tensors[name])[0].ndim >= 2 else series.qp_1d_resolved)
    return qps


def _step_size(tensors: dict[str, Any], moment: str, group: AdamGroup | MomentumGroup) -> float | None:
    """The root mean square of the optimizer's last step on the weight of first moment ``moment``,
    None if it cannot be told."""
    if isinstance(group, MomentumGroup):
        return _rms_times(group.lr, tensor_to_numpy(tensors[moment])[0].astype(np.float64))
    t = None
    if group.step is not None and group.step in tensors:
        arr = tensor_to_numpy(tensors[group.step])[0]
        t = float(arr.reshape(-1)[0]) if arr.size == 1 else None
    if t is not None and math.isfinite(t) and t >= 1:  # Adam's bias corrections at step t
        first, second = 1 - group.beta1**t, 1 - group.beta2**t
    else:  # (none where the step count is missing or not a count)
        first = second = 1.0
    partner = _partner_of(moment, tensors)
    if partner is None or first <= 0 or second <= 0:
        return None
    (m, dm, _), (v, dv, _) = tensor_to_numpy(tensors[moment]), tensor_to_numpy(tensors[partner])
    if m.shape != v.shape:
        return None
    step = np.empty(m.size, dtype=np.float64)
    _k.bias_corrected_step_into(_flat(m, dm), _flat(v, dv), first, second, group.eps, step)
    return _rms_times(group.lr, step)


def _rms_times(lr: float, step: np.ndarray) -> float | None:
    """``lr`` times the root mean square of ``step``, None unless positive and finite (an empty
    tensor's mean is NaN: no size)."""
    with np.errstate(over="ignore", invalid="ignore"):
        size = lr * float(np.sqrt(np.mean(np.square(step))))
    return size if math.isfinite(size) and size > 0 else None


def _weights(ckpt: Checkpoint) -> list[str]:
    """The float tensors of ``ckpt`` with no optimizer role: its weights (and buffers), in order."""
    state = roles(ckpt.tensors, ckpt.skeleton)
    return [n for n, t in ckpt.tensors.items() if n not in state and tensor_to_numpy(t)[1] in _FLOATS]


@dataclass(frozen=True)
class _Pairing:
    """An entry's float weights (in order), its first moments that the update domain takes (in the
    optimizer's order), and weight -> first moment for the weights paired."""

    weights: list[str]
    firsts: list[str]
    pairs: dict[str, str]


def _weight_pairs(ckpt: Checkpoint, previous: Checkpoint | None = None) -> _Pairing:
    """Each float weight of ``ckpt`` (a tensor with no optimizer role) -> its first moment: by the
    weights' changes since ``previous`` (the entry before, of the same tensors, as decoded) where
    there is one and they tell (:func:`_correlated_pairs`), the others in order as :func:`_paired`
    pairs them."""
    weights = _weights(ckpt)
    firsts = _in_optimizer_order(_update_partners(ckpt.tensors, ckpt.skeleton), ckpt.skeleton)
    pairs = {} if previous is None else _correlated_pairs(weights, ckpt.tensors, firsts, previous.tensors)
    taken = set(pairs.values())
    pairs.update(_paired([w for w in weights if w not in pairs], ckpt.tensors, [m for m in firsts if m not in taken],
                         ckpt.tensors))
    return _Pairing(weights, firsts, {w: pairs[w] for w in weights if w in pairs})


def _by_shape(weights: list[str], moments: list[str],
              tensors: dict[str, Any]) -> dict[tuple[int, ...], tuple[list[str], list[str]]]:
    """Shape -> (the ``weights`` of that shape, the ``moments`` of that shape), for the weights'
    shapes, each list in its order."""
    shapes: dict[tuple[int, ...], tuple[list[str], list[str]]] = {}
    for name in weights:
        shapes.setdefault(tensor_to_numpy(tensors[name])[0].shape, ([], []))[0].append(name)
    for m in moments:
        shape = tensor_to_numpy(tensors[m])[0].shape
        if shape in shapes:
            shapes[shape][1].append(m)
    return shapes


# Pairs by correlation. A weight's change since the entry before follows its optimizer's step
# directions, the entry's and the one before's (correlation 0.7-0.9 on the char-LSTM of
# bench_series.py), and a moment of another tensor is unrelated to it; so weights and moments are
# matched by how much of the change the two directions explain (R^2, on a sample of elements),
# whatever order the checkpoint lists its weights in: a safetensors file sorts them by name, and the
# Trainer's param groups split them by weight decay (the first moments come in neither order). A
# pair needs MIN_PAIR_R2, and PAIR_NOISE / elements where the sample is small (unrelated directions
# explain about 2 / elements); the weights left are paired in order.
PAIR_SAMPLE = 4096
MIN_PAIR_R2 = 0.04
PAIR_NOISE = 16.0


def _correlated_pairs(weights: list[str], tensors: dict[str, Any], firsts: list[str],
                      previous: dict[str, Any]) -> dict[str, str]:
    """Weight -> first moment (of its shape), the pairs whose two step directions (:func:`_direction`,
    of this entry's and of ``previous``'s moments) explain most of the weight's change since
    ``previous`` (which holds the same tensors) taken first, on the same :data:`PAIR_SAMPLE`
    elements of each shape."""
    candidates = []
    for shape, (ws, ms) in _by_shape(weights, firsts, tensors).items():
        if not ms:
            continue
        size = math.prod(shape)
        at = np.unique(np.linspace(0, size - 1, min(size, PAIR_SAMPLE)).astype(np.int64))
        changes = _unit_rows([_sampled(tensors[w], at) - _sampled(previous[w], at) for w in ws])
        now, before = (_unit_rows([_sampled_direction(source, m, at) for m in ms]) for source in (tensors, previous))
        explained = _explained(changes @ now.T, changes @ before.T, np.sum(now * before, axis=1))
        # (rounded: a last-bit difference of another BLAS must not turn a tie)
        explained = np.round(explained, 6)
        floor = max(MIN_PAIR_R2, PAIR_NOISE / at.size)
        for i, j in zip(*np.nonzero(explained >= floor)):
            candidates.append((-explained[i, j], ws[i], ms[j]))
    pairs: dict[str, str] = {}
    taken: set[str] = set()
    order = {n: k for k, n in enumerate(weights + firsts)}
    for _, w, m in sorted(candidates, key=lambda c: (c[0], order[c[1]], order[c[2]])):
        if w not in pairs and m not in taken:
            pairs[w] = m
            taken.add(m)
    return {w: pairs[w] for w in weights if w in pairs}


def _explained(a: np.ndarray, b: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """R^2 of a unit vector on two unit vectors, from its correlations ``a`` and ``b`` with them and
    theirs with each other ``rho`` (one per column): where the two are nearly one direction, the
    larger square."""
    with np.errstate(divide="ignore", invalid="ignore"):
        both = (a * a + b * b - 2 * a * b * rho) / (1 - rho * rho)
    one = np.maximum(a * a, b * b)
    return np.where(rho * rho < 0.99, np.clip(np.nan_to_num(both, nan=0.0), 0.0, 1.0), one)


def _sampled_direction(tensors: dict[str, Any], moment: str, at: np.ndarray) -> np.ndarray:
    """:func:`_direction` at the elements ``at`` alone."""
    partner = None if _is_momentum_buffer(moment) else _partner_of(moment, tensors)
    sample = {moment: _sampled(tensors[moment], at)}
    if partner is not None:
        sample[partner] = _sampled(tensors[partner], at)
    return _direction(sample, moment)


def _sampled(t: Any, at: np.ndarray) -> np.ndarray:
    return tensor_to_numpy(t)[0].reshape(-1)[at].astype(np.float64)


def _unit_rows(rows: list[np.ndarray]) -> np.ndarray:
    """The rows as a matrix, each scaled to unit length after its mean is taken out (a zero row stays zero)."""
    x = np.array(rows, dtype=np.float64)
    x -= x.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        x = np.where((norms > 0) & np.isfinite(norms), x / np.where(norms > 0, norms, 1.0), 0.0)
    return np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _paired(weights: list[str], tensors: dict[str, Any], firsts: list[str], moments: dict[str, Any]) -> dict[str, str]:
    """Weight -> its first moment, paired in order by shape (``firsts`` in the optimizer's order)."""
    pairs, k = {}, 0
    for name in weights:
        if k == len(firsts):
            break
        if tensor_to_numpy(tensors[name])[0].shape == tensor_to_numpy(moments[firsts[k]])[0].shape:
            pairs[name], k = firsts[k], k + 1
    return pairs


def _with_tensors(ckpt: Checkpoint, tensors: dict[str, Any]) -> Checkpoint:
    """``ckpt`` with other tensors (the same structure, kind, metadata and aliases)."""
    return Checkpoint(tensors, ckpt.skeleton, ckpt.kind, ckpt.metadata, dict(ckpt.aliases))


def _decoded_alone(coded: Checkpoint, names: list[str], settings: dict[str, Any], overrides: dict[str, int],
                   done: dict[str, CodedTensor]) -> dict[str, Any]:
    """The tensors ``names`` of an entry as it will decode them: coded alone, with the settings that
    reach them (:func:`_settings_of_part`), so that the entry takes them as they were coded (into
    ``done``)."""
    # (under the entry's structure, which the moments' roles come from: a state keyed by parameter
    # name has no other way to say which tensor is a second moment)
    alone = Checkpoint({n: coded.tensors[n] for n in names}, coded.skeleton)
    result = _coded(alone, _settings_of_part(names, settings, overrides), {})
    done.update(result.tensors)
    return result.decoded.tensors


def _coded(ckpt: Checkpoint, settings: dict[str, Any], done: dict[str, CodedTensor]) -> CodedModel:
    """``ckpt`` coded with the series' ``settings`` (:func:`encode_model`'s keywords), the tensors of
    ``done`` as they were coded alone."""
    threads = settings.get("threads")
    fields = {k: v for k, v in settings.items() if k not in ("threads", "progress")}
    return code_model(ckpt, EncodeSettings(**fields), reuse=done, threads=threads)


def _settings_of_part(names: list[str], settings: dict[str, Any], overrides: dict[str, int]) -> dict[str, Any]:
    """The settings that code the tensors ``names`` of an entry alone as the entry codes them: the
    qp overrides and exact patterns that reach them (in their order: the first match wins), no
    importance or BatchNorm shifts (they name the weights and touch no moment)."""
    every = set(names)

    def reaching(patterns):
        return [p for p in patterns if p in every or (is_glob(p) and any(matches(n, [p]) for n in names))]

    qps = {**overrides, **(settings.get("qp_overrides") or {})}
    part = {**settings, "importance": None, "bias_correction": False,
            "qp_overrides": {p: qps[p] for p in reaching(qps)}}
    if not isinstance(settings.get("keep_exact", False), bool):
        part["keep_exact"] = reaching(_exact_patterns(settings))
    return part


def _exact_patterns(settings: dict[str, Any]) -> list[str]:
    """The names or patterns ``keep_exact`` gives (none for True or False: all or nothing)."""
    exact = settings.get("keep_exact", False)
    return [] if isinstance(exact, bool) else [exact] if isinstance(exact, str) else list(exact)


def _in_optimizer_order(firsts, skeleton: Any) -> list[str]:
    """First-moment names by optimizer, in the order the optimizers come (a GAN's checkpoint holds
    two: each numbers its own parameters from 0), then in their param groups' order of parameters
    (:func:`first_moments`: whatever the state's keys); those of no state dict in the skeleton
    (``<optimizer>.state.<i>.exp_avg`` by name alone) after them, by optimizer, then index."""
    firsts = list(firsts)
    known = {n: k for k, n in enumerate(first_moments(skeleton))}
    optimizers: dict[str, int] = {}
    rest = [n for n in firsts if n not in known]
    for n in rest:
        optimizers.setdefault(n.rsplit(".", 2)[0], len(optimizers))
    return (sorted((n for n in firsts if n in known), key=known.__getitem__)
            + sorted(rest, key=lambda n: (optimizers[n.rsplit(".", 2)[0]], int(n.split(".")[-2]))))


def _from_update_domain(where: str, tensors: dict[str, Any], scales: Any,
                        restored: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The decoded tensors with every first moment coded in the update domain back as itself, in
    its place (those of ``restored`` as they are there)."""
    restored = restored or {}
    if not isinstance(scales, dict) or not all(
            isinstance(n, str) and type(r) is float and np.isfinite(r) and r > 0 for n, r in scales.items()):
        raise CorruptStreamError(f"{where}: malformed update-domain scales")
    if not scales:
        return tensors
    out: dict[str, Any] = {}
    for coded_name, t in tensors.items():
        name = coded_name[:-len(UPDATE_SUFFIX)] if coded_name.endswith(UPDATE_SUFFIX) else None
        if name is None:
            out[coded_name] = t
            continue
        partner = _partner_of(name, tensors)
        if name not in scales or (partner is None and not _is_momentum_buffer(name)):
            raise CorruptStreamError(f"{where}: first moment {name!r} has no second moment or scale")
        if name in restored:
            out[name] = restored[name]
            continue
        u, dtype, is_torch = tensor_to_numpy(t)
        m = _output(u.size, dtype)
        if partner is None:  # (SGD's momentum buffer: its own update domain)
            _k.times_into(_flat(u, dtype), scales[name], m)
        else:
            v, dv, _ = tensor_to_numpy(tensors[partner])
            if u.shape != v.shape:
                raise CorruptStreamError(f"{where}: first moment {name!r} does not match its second moment")
            _k.from_update_into(_flat(u, dtype), scales[name], _flat(v, dv), ADAM_EPS, m)
        out[name] = numpy_to_tensor(_carrier(m, dtype).reshape(u.shape), dtype, is_torch)
    if len(out) != len(tensors) or not set(scales) <= set(out):
        raise CorruptStreamError(f"{where}: update-domain scales name tensors the entry does not hold")
    return out


def _quantized_qps(payload: bytes) -> dict[str, int]:
    return {e.name: e.qp for e in read_stream_header(payload).tensors if e.mode.is_quantized}


def _names(listed: Any) -> list[str] | None:
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        return None
    return listed


def _floats(arr: np.ndarray, dtype: str) -> np.ndarray:
    return (bfloat16_to_float32(arr) if dtype == "bfloat16" else arr).astype(np.float64)


def _to_carrier(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded once to ``dtype``'s numpy carrier (docs/format.md: rounded once)."""
    return float64_to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype)


# The kernels (:mod:`._series_kernels`) read float32 or float64 and write the dtype of their
# output; half-precision values are widened exactly on the way in, and results meant for them are
# written in float64 and rounded once on the way out, as NumPy's expressions did.
_KERNEL_FLOATS = ("float32", "float64")


def _flat(arr: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's values (numpy carrier of ``dtype``) as a kernel reads them: flat, float32 or float64."""
    if dtype not in _KERNEL_FLOATS:
        arr = bfloat16_to_float32(arr) if dtype == "bfloat16" else arr.astype(np.float32 if dtype == "float16"
                                                                               else np.float64)
    return np.ascontiguousarray(arr).reshape(-1)


def _output(size: int, dtype: str) -> np.ndarray:
    """Where a kernel writes values meant for ``dtype`` (float64 for any other than float32 and float64)."""
    return np.empty(size, dtype=dtype if dtype in _KERNEL_FLOATS else np.float64)


def _carrier(out: np.ndarray, dtype: str) -> np.ndarray:
    """A kernel's output (:func:`_output`) as ``dtype``'s numpy carrier, rounded once."""
    return out if dtype in _KERNEL_FLOATS else _to_carrier(out, dtype)


def _residual_checkpoint(ckpt: Checkpoint, parent: Checkpoint) -> tuple[Checkpoint, list[str], list[str]]:
    """``ckpt`` with every weight-like float tensor replaced by its difference from ``parent``, and
    every second moment by log2 of its ratio to ``parent``'s (under its name with
    ``LOG_RATIO_SUFFIX``) where that is defined: the parent nonzero wherever the moment is, and
    neither negative. Returns it, the names of the residuals and of the log ratios."""
    tensors, residuals, log_ratios = {}, [], []
    kinds = roles(ckpt.tensors, ckpt.skeleton)
    for name, t in ckpt.tensors.items():
        arr, dtype, is_torch = tensor_to_numpy(t)
        if dtype in ("float32", "float64") and kinds.get(name) == SECOND_MOMENT and arr.size:
            base, base_dtype, _ = tensor_to_numpy(parent.tensors[name])
            log_ratio = np.empty(arr.size, dtype=dtype)
            if base.shape == arr.shape and _k.log_ratio_into(_flat(arr, dtype), _flat(base, base_dtype), log_ratio):
                tensors[name + LOG_RATIO_SUFFIX] = numpy_to_tensor(log_ratio.reshape(arr.shape), dtype, is_torch)
                log_ratios.append(name)
                continue
        if dtype in _FLOATS and name not in kinds and arr.size:
            base, base_dtype, _ = tensor_to_numpy(parent.tensors[name])
            # (float32 holds any difference of half-precision values; float64 stays float64)
            out_dtype = "float64" if dtype == "float64" else "float32"
            delta = np.empty(arr.size, dtype=out_dtype)
            if _k.difference_into(_flat(arr, dtype), _flat(base, base_dtype), delta):
                tensors[name] = numpy_to_tensor(delta.reshape(arr.shape), out_dtype, is_torch)
                residuals.append(name)
                continue
        tensors[name] = t
    return _with_tensors(ckpt, tensors), residuals, log_ratios


_WORDS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}
_DELTAS = {"bfloat16": "int16", "float16": "int16", "float32": "int32", "float64": "int64"}


def _order_key(words: np.ndarray) -> np.ndarray:
    """Float bits as unsigned integers in the order of the values (negatives reversed below the
    positives), so that close values have close keys."""
    top = np.array(1, dtype=words.dtype) << np.array(8 * words.itemsize - 1, dtype=words.dtype)
    return np.where(words & top, ~words, words | top)


def _from_order_key(keys: np.ndarray) -> np.ndarray:
    top = np.array(1, dtype=keys.dtype) << np.array(8 * keys.itemsize - 1, dtype=keys.dtype)
    return np.where(keys & top, keys ^ top, ~keys)


def _bit_residual_checkpoint(ckpt: Checkpoint, parent: Checkpoint,
                             pairs: dict[str, str]) -> tuple[Checkpoint, list[str], list[str], dict[str, list]]:
    """``ckpt`` with every float tensor replaced by what codes smallest of: itself, the difference
    of its order keys from ``parent``'s (a signed integer of the same width, wrapping; coded by
    magnitude class when wide), the XOR of its bits with ``parent``'s (as the same float dtype: the
    float coder drops what did not change, sign and exponent) and, for a weight with an Adam
    first moment, the difference of its keys from a prediction's (the parent plus the entry's and
    the parent's m / (sqrt(v) + eps), each times a coefficient fitted by least squares). Returns
    it, the names coded by key difference and by XOR, and the predictions: weight -> [first
    moment, c_entry, c_parent] (``pairs``: weight -> first moment, :func:`_weight_pairs`)."""
    tensors: dict[str, Any] = {}
    keyed: list[str] = []
    xored: list[str] = []
    predicted: dict[str, list] = {}
    for name, t in ckpt.tensors.items():
        arr, dtype, is_torch = tensor_to_numpy(t)
        words = _WORDS.get(dtype)
        if words is None or not arr.size:
            tensors[name] = t
            continue
        base, _, _ = tensor_to_numpy(parent.tensors[name])
        mine = np.require(arr, requirements="C").view(words)
        theirs = np.require(base, requirements="C").view(words)
        delta = np.asarray(_order_key(mine) - _order_key(theirs)).reshape(arr.shape).view(_DELTAS[dtype])
        xor = np.asarray(mine ^ theirs).reshape(arr.shape).view(arr.dtype)
        options: list[tuple[Any, Any]] = [(t, None), (numpy_to_tensor(xor, dtype, is_torch), xored),
                                          (numpy_to_tensor(delta, _DELTAS[dtype], is_torch), keyed)]
        if name in pairs:
            moment = pairs[name]
            fit = _fitted_prediction(_floats(arr, dtype) - _floats(base, dtype), ckpt.tensors, parent.tensors, moment)
            if fit is not None:
                coefs, now, before = fit
                guess = np.require(_predicted_bits(base, dtype, _combined(coefs, now, before)),
                                   requirements="C").view(words)
                wrong = np.asarray(_order_key(mine) - _order_key(guess)).reshape(arr.shape).view(_DELTAS[dtype])
                options.append((numpy_to_tensor(wrong, _DELTAS[dtype], is_torch), (moment, *coefs)))
        sizes = [len(encode_model({name: option}, keep_exact=True, threads=1)) for option, _ in options]
        chosen, names = options[int(np.argmin(sizes))]
        tensors[name] = chosen
        if isinstance(names, tuple):  # (a prediction: its moment and coefficients)
            predicted[name] = list(names)
        elif names is not None:
            names.append(name)
    return _with_tensors(ckpt, tensors), keyed, xored, predicted


def _predicted_bits(base: np.ndarray, dtype: str, change: np.ndarray) -> np.ndarray:
    """The parent plus a predicted change, rounded once to ``dtype`` (its carrier)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _to_carrier(_floats(base, dtype) + change, dtype)


def _same_tensors(a: Checkpoint, b: Checkpoint) -> bool:
    if list(a.tensors) != list(b.tensors):
        return False
    for name, t in a.tensors.items():
        x, dx, _ = tensor_to_numpy(t)
        y, dy, _ = tensor_to_numpy(b.tensors[name])
        if x.shape != y.shape or dx != dy:
            return False
    return True


def _step_of(ckpt: Checkpoint) -> int | None:
    """The training step a checkpoint records at its top level (``step``, ``global_step``)."""
    root = ckpt.skeleton.get("root") if isinstance(ckpt.skeleton, dict) else None
    items = root.get("$dict") if isinstance(root, dict) else None
    for key, value in items or []:
        if key in ("global_step", "step") and type(value) is int:
            return value
    return None
