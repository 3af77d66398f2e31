"""Rate control around :func:`deepcabac_py.encode_model`.

:func:`encode_to_size` hits a byte or bits-per-weight budget (to within one qp step, then to within
1% by the lambda of the RD quantizer); :func:`encode_for_fidelity` finds the smallest stream whose
decoded model keeps a user fidelity at or above a threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..io.checkpoint import Checkpoint, flatten
from ..model.decoder import decode_model
from ..model.encoder import encode_model


def _param_count(model) -> int:
    return (model if isinstance(model, Checkpoint) else flatten(model)).numel


def encode_to_size(model, *, target_bytes: int | None = None, target_bpw: float | None = None,
                   qp_range: tuple[int, int] = (-80, 40), **encode_kwargs) -> bytes:
    """The stream of ``model`` closest to a size budget without exceeding it.

    Give ``target_bytes`` or ``target_bpw`` (bits per parameter, all tensors counted). The qp is
    searched first (each step of qp changes the size by a few percent); between the last qp that
    fits and the next finer one, the lambda of the RD quantizer is raised until the stream is within
    1% of the budget (with the ``nearest`` quantizer, within one qp step). Other arguments go to
    :func:`encode_model`. Raises ``ValueError`` if even the coarsest qp of ``qp_range`` is too big.
    """
    if (target_bytes is None) == (target_bpw is None):
        raise ValueError("give exactly one of target_bytes and target_bpw")
    if "qp" in encode_kwargs:
        raise ValueError("encode_to_size chooses qp itself; do not pass qp")
    if target_bpw is not None:
        if not (target_bpw > 0 and math.isfinite(target_bpw)):
            raise ValueError(f"target_bpw must be a positive number, got {target_bpw}")
        target_bytes = int(target_bpw * _param_count(model) / 8)
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, (int, np.integer)) or target_bytes <= 0:
        raise ValueError(f"target_bytes must be a positive integer, got {target_bytes!r}")
    target = int(target_bytes)
    lo, hi = qp_range  # fine, coarse
    cache: dict[tuple[int, float], bytes] = {}
    base_scale = float(encode_kwargs.pop("lambda_scale", 1.0))

    def enc(qp: int, scale: float = base_scale) -> bytes:
        key = (qp, scale)
        if key not in cache:
            cache[key] = encode_model(model, qp=qp, lambda_scale=scale, **encode_kwargs)
        return cache[key]

    if len(enc(hi)) > target:
        raise ValueError(f"even qp {hi} gives {len(enc(hi))} bytes, more than the {target}-byte budget")
    if len(enc(lo)) <= target:
        return enc(lo)
    # invariant: enc(lo) too big, enc(hi) fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(enc(mid)) <= target:
            hi = mid
        else:
            lo = mid
    best = enc(hi)
    if len(best) >= 0.99 * target or encode_kwargs.get("quantizer") == "nearest":
        return best
    # Finer step, larger lambda: the RD quantizer trades the remaining bytes continuously.
    a, b = base_scale, base_scale * 64.0
    if len(enc(lo, b)) > target:
        return best
    for _ in range(12):
        scale = math.sqrt(a * b) if a > 0 else b / 2
        if len(enc(lo, scale)) <= target:
            b = scale
        else:
            a = scale
        if len(enc(lo, b)) >= 0.99 * target:
            break
    tuned = enc(lo, b)
    return tuned if len(tuned) > len(best) else best


def encode_for_fidelity(model, fidelity: Callable[[Any], float], threshold: float, *,
                        qp_range: tuple[int, int] = (-60, 0), **encode_kwargs) -> bytes:
    """The smallest stream (coarsest qp in ``qp_range``) whose decoded model keeps
    ``fidelity(decoded) >= threshold``.

    ``fidelity`` receives what :func:`decode_model` returns (the model's structure with decoded
    tensors) and returns a number that grows with fidelity (an accuracy, a cosine; pass the negative
    of a divergence). Fidelity is assumed to fall monotonically as qp grows; the search is a
    bisection over qp. Raises ``ValueError`` if even the finest qp misses the threshold.
    """
    if "qp" in encode_kwargs:
        raise ValueError("encode_for_fidelity chooses qp itself; do not pass qp")
    lo, hi = qp_range
    cache: dict[int, tuple[bytes, float]] = {}

    def trial(qp: int) -> tuple[bytes, float]:
        if qp not in cache:
            data = encode_model(model, qp=qp, **encode_kwargs)
            cache[qp] = (data, float(fidelity(decode_model(data))))
        return cache[qp]

    if trial(lo)[1] < threshold:
        raise ValueError(f"even qp {lo} keeps fidelity {trial(lo)[1]:.6g}, below the threshold {threshold}")
    if trial(hi)[1] >= threshold:
        return trial(hi)[0]
    while hi - lo > 1:  # invariant: lo meets the threshold, hi does not
        mid = (lo + hi) // 2
        if trial(mid)[1] >= threshold:
            lo = mid
        else:
            hi = mid
    return trial(lo)[0]
