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

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import CorruptStreamError, OutputError
from ..io.checkpoint import Checkpoint, flatten, numpy_to_tensor, tensor_to_numpy, unflatten
from ..io.directories import DIRECTORY_KIND, load_checkpoint_directory, save_checkpoint_directory
from ..io.files import load_checkpoint, save_checkpoint
from ..io.kinds import kind_from_suffix
from ..model.decoder import decode_checkpoint
from ..model.encoder import CodedModel, CodedTensor
from ..model.optimizer_state import roles
from ..model.settings import DEFAULT_MOMENTS_QP, matches
from . import _series_kernels as _k
from . import arrays, bit_residuals, carried_files, changes, coding, moments, predictions, steps
from .records import SeriesFile

__all__ = ["CheckpointSeries", "SeriesEntry", "DEFAULT_KEY_EVERY", "DEFAULT_SERIES_QP"]

DEFAULT_KEY_EVERY = 10
# The weights' finest qp in a lossy series unless one is given: an entry is kept to be resumed from,
# so its weights stay about as close as a bfloat16 copy of them (a step of 2**-13). On the runs of
# benchmarks/bench_series.py, encode's default (-32) moves the digits CNN's held-out loss by up to
# 12% and turns its next Adam step by a cosine of 0.91; -52 moves it by 0.2% at a cosine of 0.995.
DEFAULT_SERIES_QP = -52
KEY = "key"  # (an entry coded on its own; the others are changes.RESIDUAL)


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
        ``DEFAULT_SERIES_QP`` (:data:`steps.STEP_FRACTION`).
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
            meta: dict[str, Any] = {"kind": KEY if parent is None else changes.RESIDUAL,
                                    "parent": None if parent is None else index - 1, "step": _step_of(ckpt)}
            # (a key after the first pairs its weights by the entry before too, where this object
            # holds it: the pairs then do not depend on the order the checkpoint lists its tensors in)
            previous = parent
            if previous is None and self._last is not None and self._last[0] == index - 1 \
                    and _same_tensors(self._last[1], ckpt):
                previous = self._last[1]
            pairing = steps.weight_pairs(ckpt, previous)
            work = _Work()
            if parent is None:
                result = self._key_entry(ckpt, pairing, meta, work)
                self._key = (index, coding.quantized_qps(result.data))
                residuals: list[str] = []
            elif self.settings.get("keep_exact") is True:
                result = self._bit_residual_entry(ckpt, parent, pairing, meta, work)
                residuals = []
            else:
                result, residuals = self._residual_entry(ckpt, parent, self._key_qps(f, index), pairing, meta, work)
            meta["residuals"] = residuals
            f.append(meta, result.data)
            # (the entry as a reader will decode it, from the levels as they were coded)
            self._last = (index, _reconstruct(f.path, index, result.decoded, meta, parent, work.restored))
        return index

    def _stepped(self, ckpt: Checkpoint, pairing: steps.Pairing) -> dict[str, tuple[int, int]]:
        """The weights' qps by their optimizer's step (:func:`.steps.step_qps`), unless a qp was given."""
        return steps.step_qps(ckpt, self.settings, pairing) if self._steps_from_optimizer else {}

    def _key_entry(self, ckpt: Checkpoint, pairing: steps.Pairing, meta: dict[str, Any], work: _Work) -> CodedModel:
        """``ckpt`` coded on its own (its first moments in the update domain: into ``meta``)."""
        settings = dict(self.settings)
        coded = ckpt
        if self.settings.get("keep_exact") is not True:
            coarser = {n: qp for n, (qp, base) in self._stepped(ckpt, pairing).items() if qp > base}
            coded, meta["update_domain"], overrides, _ = _in_update_domain(ckpt, settings, coarser, [], None, work)
            settings["qp_overrides"] = {**overrides, **(self.settings.get("qp_overrides") or {})}
        return coding.code_entry(coded, settings, work.tensors)

    def _bit_residual_entry(self, ckpt: Checkpoint, parent: Checkpoint, pairing: steps.Pairing,
                            meta: dict[str, Any], work: _Work) -> CodedModel:
        """``ckpt`` coded losslessly against ``parent`` (:mod:`.bit_residuals`; what it chose: into
        ``meta``)."""
        coded, keyed, xored, meta["bit_predicted"] = bit_residuals.residual_checkpoint(ckpt, parent, pairing.pairs)
        meta["bit_residuals"], meta["xor_residuals"] = keyed, xored
        return coding.code_entry(_carried_against(coded, parent, meta), self.settings, work.tensors)

    def _residual_entry(self, ckpt: Checkpoint, parent: Checkpoint, key_qps: dict[str, int], pairing: steps.Pairing,
                        meta: dict[str, Any], work: _Work) -> tuple[CodedModel, list[str]]:
        """``ckpt`` coded against ``parent`` (its key's qps ``key_qps``; how: into ``meta``), and the
        names of its residuals."""
        coded, residuals, log_ratios = changes.residual_checkpoint(ckpt, parent)
        meta["log_ratios"] = log_ratios
        # A residual is not a model (no importance from its own structure, no BatchNorm shifts):
        # each residual gets the qp its tensor got in the key, where the model's structure chose it
        # (finer where errors cost more).
        settings = {"importance": None, "bias_correction": False, **self.settings}
        log_ratio_qp = settings.get("moments_qp", DEFAULT_MOMENTS_QP) + changes.LOG_RATIO_QP_OFFSET
        # (a weight whose key took its optimizer's step size takes its own now, or the series' qp:
        # training may have slowed since the key)
        overrides = {**{n: key_qps[n] for n in residuals if n in key_qps},
                     **{n: qp if qp > base else min(key_qps.get(n, base), base)
                        for n, (qp, base) in self._stepped(ckpt, pairing).items() if n in residuals},
                     **{n + changes.LOG_RATIO_SUFFIX: log_ratio_qp for n in log_ratios}}
        coded, meta["update_domain"], overrides, seconds = _in_update_domain(coded, settings, overrides, log_ratios,
                                                                             parent, work)
        coded, meta["predicted"], meta["v_scaled"] = _predicted_residuals(
            coded, residuals, settings, overrides, meta["update_domain"], seconds, parent, pairing.pairs, work)
        settings["qp_overrides"] = {**overrides, **(self.settings.get("qp_overrides") or {})}
        return coding.code_entry(_carried_against(coded, parent, meta), settings, work.tensors), residuals

    def _key_qps(self, f: SeriesFile, index: int) -> dict[str, int]:
        """The qp of every quantized tensor of the key that entry ``index`` descends from (read
        from the file only by an object that did not append that key itself)."""
        i = index - 1
        while i > 0 and f.records[i].meta.get("kind") != KEY:
            i -= 1
        if self._key is None or self._key[0] != i:
            self._key = (i, coding.quantized_qps(f.payload(f.records[i])))
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
            if meta.get("kind") != changes.RESIDUAL or parent != chain[-1] - 1:
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
        return arrays.with_tensors(decoded, moments.from_update_domain(where, decoded.tensors,
                                                                       meta.get("update_domain", {}), restored))
    if parent is None:
        raise CorruptStreamError(f"{path}: entry {index} is a residual without its parent")
    if "carried" in meta:
        decoded = replace(decoded, skeleton=carried_files.restored(where, decoded.skeleton, meta["carried"],
                                                                   parent.skeleton))
    residuals, ratios = _names(meta.get("residuals")), _names(meta.get("ratios", []))
    keyed, xored = _names(meta.get("bit_residuals", [])), _names(meta.get("xor_residuals", []))
    log_ratios = _names(meta.get("log_ratios", []))
    if (residuals is None or ratios is None or keyed is None or xored is None or log_ratios is None
            or not set(residuals + ratios + keyed + xored + [n + changes.LOG_RATIO_SUFFIX for n in log_ratios])
            <= set(decoded.tensors)):
        raise CorruptStreamError(f"{path}: entry {index} lists residuals it does not hold")
    tensors = changes.from_log_ratios(where, decoded.tensors, log_ratios, parent, restored)
    # (the moments' roles by the entry's structure, a state dict keyed by parameter names too: the
    # names each tensor has once the update domain is undone)
    moment_roles = roles([n.removesuffix(moments.UPDATE_SUFFIX) for n in tensors], decoded.skeleton)
    bit_predicted = predictions.read_predicted(where, meta.get("bit_predicted", {}),
                                 [n for n in decoded.tensors if n not in keyed + xored], tensors, moment_roles)
    bit_residuals.restored(where, tensors, parent.tensors, keyed, xored, bit_predicted)
    for name in ratios:
        tensors[name] = changes.applied(where, name, tensors[name], parent.tensors.get(name), changes.RATIO)
    # the moments first: a residual may be predicted from the step they make
    tensors = moments.from_update_domain(where, tensors, meta.get("update_domain", {}), restored)
    predicted = predictions.read_predicted(where, meta.get("predicted", {}), residuals, tensors, moment_roles)
    scaled = predictions.read_scaled(where, meta.get("v_scaled", {}), list(predicted), tensors, moment_roles)
    for name in residuals:
        guess = scale = None
        if name in predicted:
            moment, coefs = predicted[name]
            guess = (*predictions.prediction_moments(tensors, parent.tensors, moment), coefs)
        if name in scaled:
            second, mean = scaled[name]
            v, dv, _ = tensor_to_numpy(tensors[second])
            scale = (v, dv, mean)
        tensors[name] = changes.applied(where, name, tensors[name], parent.tensors.get(name), changes.RESIDUAL, guess,
                                        scale)
    return arrays.with_tensors(decoded, tensors)


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


def _in_update_domain(coded: Checkpoint, settings: dict[str, Any], overrides: dict[str, int], log_ratios: list[str],
                      parent: Checkpoint | None, work: _Work
                      ) -> tuple[Checkpoint, dict[str, float], dict[str, int], dict[str, Any]]:
    """``coded`` (an entry as it will be coded) with its first moments in the update domain, their
    ``r`` by name, the qp overrides with theirs, and the second moments they are divided by as the
    entry decodes them: coded alone with the entry's settings (each is quantized on its own,
    without importance: the same levels; into ``work``), their log2 ratios applied to the parent's
    (restored: into ``work`` too)."""
    # (a second moment coded as a log2 ratio has its moment's shape and dtype)
    partners = moments.update_partners(
        {**coded.tensors, **{n: coded.tensors[n + changes.LOG_RATIO_SUFFIX] for n in log_ratios}}, coded.skeleton)
    if not partners:
        return coded, {}, overrides, {}
    names = sorted({p for p in partners.values() if p is not None})
    sources = sorted(n + changes.LOG_RATIO_SUFFIX if n in log_ratios else n for n in names)
    decoded = coding.decoded_alone(coded, sources, settings, overrides, work.tensors) if sources else {}
    if log_ratios:
        if parent is None:
            raise RuntimeError("internal error: log2 ratios without a parent")
        decoded = changes.from_log_ratios("a second moment", decoded, [n for n in names if n in log_ratios], parent)
    seconds = {n: decoded[n] for n in names}
    work.restored.update(seconds)
    second = {n: arrays.flat(*tensor_to_numpy(t)[:2]) for n, t in seconds.items()}
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
                _k.direction_into(arrays.flat(m, dtype), second[partner], moments.ADAM_EPS, u)
            with np.errstate(over="ignore", invalid="ignore"):
                r = float(np.sqrt(np.mean(u * u)))
            if np.isfinite(r) and r > 0:
                out = np.empty(m.size, dtype=dtype)  # (float32 or float64: moments.update_partners)
                if _k.divided_into(u.reshape(-1), r, out):
                    tensors[name + moments.UPDATE_SUFFIX] = numpy_to_tensor(out.reshape(m.shape), dtype, is_torch)
                    scales[name] = r
                    overrides[name + moments.UPDATE_SUFFIX] = moments.UPDATE_QP
                    continue
        tensors[name] = t
    return arrays.with_tensors(coded, tensors), scales, overrides, seconds


# A weight's residual is predicted from its step direction (:func:`.moments.direction`) only where
# that takes this share of its energy at least (a pairing that does not hold costs a number and
# nothing more)
MIN_PREDICTION_GAIN = 0.05


def _predicted_residuals(coded: Checkpoint, residuals: list[str], settings: dict[str, Any], overrides: dict[str, int],
                         scales: dict[str, float], seconds: dict[str, Any], parent: Checkpoint,
                         pairs: dict[str, str], work: _Work
                         ) -> tuple[Checkpoint, dict[str, list], dict[str, list]]:
    """``coded`` with each weight's residual less its prediction from the step directions of its
    first moment (:func:`.moments.direction`), as the entry decodes it and as the parent did (the
    steps since the parent follow the moments: for the char-LSTM of bench_series their correlation
    is 0.7-0.9), the two coefficients fitted by least squares, and then in its second moment's
    scale (:func:`._series_kernels.residual_scale`; Adam's only); the meta's ``predicted``: weight
    -> [first moment, c_entry, c_parent], and ``v_scaled``: weight -> [second moment, its mean].
    ``scales`` are the first moments' in the update domain and ``seconds`` the second moments as
    :func:`_in_update_domain` decoded them; ``pairs`` pair weights with first moments
    (:func:`.steps.weight_pairs`); the first moments as coded and as restored go into ``work``."""
    firsts = moments.in_optimizer_order(scales, coded.skeleton)
    if not firsts or not residuals:
        return coded, {}, {}
    # the first moments as the entry decodes them (quantized on their own: the same levels)
    sources = sorted(m + moments.UPDATE_SUFFIX for m in firsts)
    decoded = coding.decoded_alone(coded, sources, settings, overrides, work.tensors)
    decoded = moments.from_update_domain("a first moment", {**seconds, **decoded}, scales)
    work.restored.update({m: decoded[m] for m in firsts})
    tensors = dict(coded.tensors)
    predicted: dict[str, list] = {}
    v_scaled: dict[str, list] = {}
    exact = coding.exact_patterns(settings)
    wanted = set(residuals)
    for name, moment in ((w, m) for w, m in pairs.items() if w in wanted and m in scales):
        delta, dtype, is_torch = tensor_to_numpy(coded.tensors[name])
        if matches(name, exact):  # (kept as its residual is: a prediction would round it)
            continue
        d = delta.astype(np.float64).reshape(-1)
        fit = predictions.fitted_prediction(d, decoded, parent.tensors, moment)
        if fit is None:
            continue
        coefs, now, before = fit
        rest = np.empty(d.size, dtype=np.float64)
        _k.rest_into(d, now.reshape(-1), before.reshape(-1), coefs[0], coefs[1], rest)
        if not np.all(np.isfinite(rest)) or np.vdot(rest, rest) > (1 - MIN_PREDICTION_GAIN) * np.vdot(d, d):
            continue
        out = np.empty(d.size, dtype=dtype)  # (a residual is float32 or float64: changes.residual_checkpoint)
        # (a first moment in the update domain has a second moment of its shape)
        second = moments.partner_of(moment, decoded)
        v = arrays.flat(*tensor_to_numpy(decoded[second])[:2]) if second is not None else None
        mean = float(np.mean(np.abs(v.astype(np.float64)))) if v is not None else 0.0
        if v is not None and np.isfinite(mean) and mean > 0:
            _k.scaled_by_moment_into(rest, v, mean, changes.RESIDUAL_SCALE_FLOOR, out)
            v_scaled[name] = [second, mean]
        else:
            out[:] = rest
        tensors[name] = numpy_to_tensor(out.reshape(delta.shape), dtype, is_torch)
        predicted[name] = [moment, *coefs]
    return arrays.with_tensors(coded, tensors), predicted, v_scaled


def _names(listed: Any) -> list[str] | None:
    if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
        return None
    return listed


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
