"""Each weight's optimizer step: which first moment is the weight's (paired by the weight's
change where the entry before is at hand, else in order by shape), and how large a step it takes
(the weight's qp)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..io.checkpoint import Checkpoint, tensor_to_numpy
from ..model.optimizer_state import AdamGroup, MomentumGroup, adam_groups, momentum_groups, roles
from ..model.settings import EncodeSettings, lookup_qp
from ..quant.steps import qp_at_most
from . import _series_kernels as _k
from . import arrays, moments


def float_weights(ckpt: Checkpoint) -> list[str]:
    """The float tensors of ``ckpt`` with no optimizer role: its weights (and buffers), in order."""
    state = roles(ckpt.tensors, ckpt.skeleton)
    return [n for n, t in ckpt.tensors.items() if n not in state and tensor_to_numpy(t)[1] in arrays.FLOATS]


@dataclass(frozen=True)
class Pairing:
    """An entry's float weights (in order), its first moments that the update domain takes (in the
    optimizer's order), and weight -> first moment for the weights paired."""

    weights: list[str]
    firsts: list[str]
    pairs: dict[str, str]


def weight_pairs(ckpt: Checkpoint, previous: Checkpoint | None = None) -> Pairing:
    """Each float weight of ``ckpt`` (a tensor with no optimizer role) -> its first moment: by the
    weights' changes since ``previous`` (the entry before, of the same tensors, as decoded) where
    there is one and they tell (:func:`correlated_pairs`), the others in order as :func:`_paired`
    pairs them."""
    weights = float_weights(ckpt)
    firsts = moments.in_optimizer_order(moments.update_partners(ckpt.tensors, ckpt.skeleton), ckpt.skeleton)
    pairs = {} if previous is None else correlated_pairs(weights, ckpt.tensors, firsts, previous.tensors)
    taken = set(pairs.values())
    pairs.update(_paired([w for w in weights if w not in pairs], ckpt.tensors, [m for m in firsts if m not in taken],
                         ckpt.tensors))
    return Pairing(weights, firsts, {w: pairs[w] for w in weights if w in pairs})


def _by_shape(weights: list[str], firsts: list[str],
              tensors: dict[str, Any]) -> dict[tuple[int, ...], tuple[list[str], list[str]]]:
    """Shape -> (the ``weights`` of that shape, the ``firsts`` of that shape), for the weights'
    shapes, each list in its order."""
    shapes: dict[tuple[int, ...], tuple[list[str], list[str]]] = {}
    for name in weights:
        shapes.setdefault(tensor_to_numpy(tensors[name])[0].shape, ([], []))[0].append(name)
    for m in firsts:
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


def correlated_pairs(weights: list[str], tensors: dict[str, Any], firsts: list[str],
                     previous: dict[str, Any]) -> dict[str, str]:
    """Weight -> first moment (of its shape), the pairs whose two step directions
    (:func:`.moments.direction`, of this entry's and of ``previous``'s moments) explain most of the
    weight's change since ``previous`` (which holds the same tensors) taken first, on the same
    :data:`PAIR_SAMPLE` elements of each shape."""
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
    """:func:`.moments.direction` at the elements ``at`` alone."""
    partner = None if moments.is_momentum_buffer(moment) else moments.partner_of(moment, tensors)
    sample = {moment: _sampled(tensors[moment], at)}
    if partner is not None:
        sample[partner] = _sampled(tensors[partner], at)
    return moments.direction(sample, moment)


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


def _paired(weights: list[str], tensors: dict[str, Any], firsts: list[str], held: dict[str, Any]) -> dict[str, str]:
    """Weight -> its first moment, paired in order by shape (``firsts`` in the optimizer's order)."""
    pairs, k = {}, 0
    for name in weights:
        if k == len(firsts):
            break
        if tensor_to_numpy(tensors[name])[0].shape == tensor_to_numpy(held[firsts[k]])[0].shape:
            pairs[name], k = firsts[k], k + 1
    return pairs


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


def step_qps(ckpt: Checkpoint, settings: dict[str, Any], pairing: Pairing) -> dict[str, tuple[int, int]]:
    """Weight -> (its qp by the size of the optimizer's last step on it, ``settings``' qp for it:
    ``qp``, or ``qp_1d`` for at most one dimension), for the weights of ``ckpt`` whose Adam or SGD
    state (moments and param group) it holds, paired with their first moments by ``pairing``
    (:func:`weight_pairs`), and no qp override of ``settings`` names (those win).

    A weight left unpaired (the first key of a checkpoint that lists its weights in another order
    than its optimizer numbers them: a safetensors file sorts them by name) takes the smallest
    step of the unpaired first moments of its shape, where the shape has no more unpaired weights
    than those moments (so that no buffer, BatchNorm's running statistics say, can be among them):
    finer than its own step, whichever moment that is."""
    groups: dict[str, AdamGroup | MomentumGroup] = {**adam_groups(ckpt.skeleton), **momentum_groups(ckpt.skeleton)}
    given = settings.get("qp_overrides") or {}
    series = EncodeSettings(**{k: settings[k] for k in ("qp", "qp_density", "qp_1d") if k in settings})
    pairs = pairing.pairs
    sizes = {name: step_size(ckpt.tensors, moment, groups[moment]) if moment in groups else None
             for name, moment in pairs.items()}
    taken = set(pairs.values())
    spare = _by_shape([w for w in pairing.weights if w not in pairs], [m for m in pairing.firsts if m not in taken],
                      ckpt.tensors)
    for ws, ms in spare.values():
        steps = [step_size(ckpt.tensors, m, groups[m]) if m in groups else None for m in ms]
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


def step_size(tensors: dict[str, Any], moment: str, group: AdamGroup | MomentumGroup) -> float | None:
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
    partner = moments.partner_of(moment, tensors)
    if partner is None or first <= 0 or second <= 0:
        return None
    (m, dm, _), (v, dv, _) = tensor_to_numpy(tensors[moment]), tensor_to_numpy(tensors[partner])
    if m.shape != v.shape:
        return None
    step = np.empty(m.size, dtype=np.float64)
    _k.bias_corrected_step_into(arrays.flat(m, dm), arrays.flat(v, dv), first, second, group.eps, step)
    return _rms_times(group.lr, step)


def _rms_times(lr: float, step: np.ndarray) -> float | None:
    """``lr`` times the root mean square of ``step``, None unless positive and finite (an empty
    tensor's mean is NaN: no size)."""
    with np.errstate(over="ignore", invalid="ignore"):
        size = lr * float(np.sqrt(np.mean(np.square(step))))
    return size if math.isfinite(size) and size > 0 else None
