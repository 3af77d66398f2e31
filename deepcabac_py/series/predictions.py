"""A weight's change since the parent as its optimizer's step directions predict it (the
entry's and the parent's, each times a coefficient fitted by least squares): the writer's fit, and
the reader's checks of what an entry's meta names."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CorruptStreamError
from ..io.checkpoint import tensor_to_numpy
from ..model.optimizer_state import FIRST_MOMENT, SECOND_MOMENT
from ..quant import portable
from . import moments


def prediction_moments(tensors: dict[str, Any], parent: dict[str, Any],
                       moment: str) -> tuple[moments.Moments, moments.Moments]:
    """What a prediction from first moment ``moment`` reads: the entry's and the parent's moments
    (:func:`.moments.direction_inputs`), checked."""
    if moment not in parent:
        raise CorruptStreamError(f"prediction from {moment!r}, which the parent does not hold")
    return moments.direction_inputs(tensors, moment), moments.direction_inputs(parent, moment)


def prediction(tensors: dict[str, Any], parent: dict[str, Any], moment: str, coefs: tuple[float, float]) -> np.ndarray:
    """A weight's change since the parent as its entry's and its parent's step directions of first
    moment ``moment`` predict it (the optimizer's steps in between went from the one to the other)."""
    now, before = prediction_moments(tensors, parent, moment)
    return combined(coefs, moments.direction_of(*now), moments.direction_of(*before))


def combined(coefs: tuple[float, float], now: np.ndarray, before: np.ndarray) -> np.ndarray:
    """The prediction of coefficients ``coefs`` on the two directions (the reader's arithmetic)."""
    return coefs[0] * now + coefs[1] * before


def fitted_prediction(change: np.ndarray, tensors: dict[str, Any], parent: dict[str, Any],
                      moment: str) -> tuple[tuple[float, float], np.ndarray, np.ndarray] | None:
    """The writer's side of :func:`prediction`: the coefficients of ``change`` on the entry's and
    the parent's directions of ``moment``, and those directions (each computed once), None where
    the coefficients do not hold."""
    now, before = moments.direction(tensors, moment), moments.direction(parent, moment)
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


def read_predicted(where: str, listed: Any, residuals: list[str], tensors: dict[str, Any],
                   moment_roles: dict[str, str]) -> dict[str, tuple[str, tuple[float, float]]]:
    """The meta's ``predicted``, checked: residual name -> (first moment, coefficients)."""
    refs = _moment_references(where, listed, residuals, tensors, moment_roles, role=FIRST_MOMENT, what="prediction",
                              numbers=lambda xs: len(xs) == 2 and all(type(c) is float and np.isfinite(c) for c in xs))
    return {name: (moment, (xs[0], xs[1])) for name, (moment, xs) in refs.items()}


def read_scaled(where: str, listed: Any, predicted: list[str], tensors: dict[str, Any],
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
