"""Rate-distortion control on top of :func:`deepcabac_py.encode_model`.

* :func:`diagonal_fisher`: per-weight importance from a model, a loss and a few calibration
  batches (the mean squared gradient). Passed as ``encode_model(..., importance=...)`` it weights
  the squared error of every weight in the RD quantizers and sets each tensor's step
  (:func:`allocate_qps`).
* :func:`allocate_qps`: bit allocation across tensors. With importance ``F`` the expected loss of
  fidelity of a tensor quantized with step ``d`` grows as ``mean(F) * d**2`` while its rate falls by
  one bit per weight per halving of ``d``; the marginal loss per bit is equal across tensors when
  ``mean(F) * d**2`` is the same for all of them.
* :func:`encode_to_size` and :func:`encode_for_fidelity`: rate control. The first hits a byte or
  bits-per-weight budget (to within one qp step, then to within 1% by the lambda of the RD
  quantizer); the second finds the smallest stream whose decoded model keeps a user fidelity at or
  above a threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from . import quantize

# A tensor's step moves at most this many octaves away from the reference step: the importance of a
# tensor seen through a few calibration batches is an estimate, and a tensor the batches barely
# touch must not lose all its bits.
MAX_OCTAVES = 3
# step ~ mean(importance) ** -ALLOCATION_EXPONENT. 1/2 is the high-rate optimum; with importance
# from a few calibration batches and at the rates that matter, a milder 0.35 measured better
# (EfficientNet-Lite0, benchmarks/bench_rd.py: about 0.81x NNCodec's bytes at equal mean KL with
# 0.35, 0.83-0.86x with 0.5).
ALLOCATION_EXPONENT = 0.35


def diagonal_fisher(model, batches: Iterable[Any], loss_fn: Callable[[Any, Any], Any], *,
                    names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Mean squared gradient of ``loss_fn(model, batch)`` over ``batches``, per parameter.

    ``model`` is a ``torch.nn.Module``; the result maps its state-dict names (of the parameters
    that require gradients, or of ``names``) to float32 arrays of the parameter's shape. With a loss
    whose gradient samples the model's own output distribution (cross-entropy against labels drawn
    from its softmax; a random projection of an embedding) this is the diagonal of the Fisher
    information, which predicts how much a small change of each weight moves the outputs.
    """
    import torch

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if names is not None:
        wanted = list(names)
        missing = [n for n in wanted if n not in params]
        if missing:
            raise ValueError(f"not parameters of the model: {', '.join(missing[:5])}")
        params = {n: params[n] for n in wanted}
    if not params:
        raise ValueError("the model has no parameters that require gradients")
    order = list(params)
    sums = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in order}
    count = 0
    for batch in batches:
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        grads = torch.autograd.grad(loss, [params[n] for n in order], allow_unused=True)
        for n, g in zip(order, grads):
            if g is not None:
                sums[n] += g.detach().to(torch.float64) ** 2
        count += 1
    if count == 0:
        raise ValueError("no calibration batches")
    return {n: (sums[n] / count).to(torch.float32).cpu().numpy() for n in order}


def allocate_qps(importance: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], qp: int, *,
                 qp_density: int = 2, qp_1d: int | None = None,
                 reference: float | None = None) -> dict[str, int]:
    """A qp per tensor of ``importance`` such that ``mean importance * step**2`` is equal across
    tensors (equal marginal loss of fidelity per bit).

    ``qp`` is the step of a tensor of reference importance: ``2**reference`` if given, else the
    geometric mean, weighted by size, of the tensors with two or more dimensions. Steps stay within
    ``MAX_OCTAVES`` octaves of ``qp`` and, if ``qp_1d`` is given, no finer than it; a tensor whose
    importance is zero everywhere gets the coarsest of them.
    """
    quantize.step_from_qp(qp, qp_density)
    means: dict[str, float] = {}
    unused: list[str] = []  # importance 0 throughout: nothing the importance saw depends on it
    for name, imp in importance.items():
        arr = np.asarray(imp)  # (no float64 copy: importance may be a broadcast view)
        if arr.size and np.isfinite(float(arr.min())) and np.isfinite(float(arr.max())):
            m = float(arr.mean(dtype=np.float64))
            if m > 0.0:
                means[name] = m
            elif m == 0.0:
                unused.append(name)
    ref_names = [n for n in means if len(shapes.get(n, ())) >= 2] or list(means)
    if not ref_names:
        return {}
    if reference is not None:
        ref = float(reference)
    else:
        sizes = np.array([float(np.prod(shapes.get(n, np.shape(importance[n])))) for n in ref_names])
        logs = np.array([math.log2(means[n]) for n in ref_names])
        ref = float(np.sum(sizes * logs) / np.sum(sizes))
    per_octave = 1 << qp_density
    out = {}
    for name, m in means.items():
        octaves = ALLOCATION_EXPONENT * (math.log2(m) - ref)  # 4x as important: half the step
        octaves = min(MAX_OCTAVES, max(-MAX_OCTAVES, octaves))
        t_qp = qp - int(round(octaves * per_octave))
        if qp_1d is not None:
            t_qp = max(t_qp, qp_1d)
        out[name] = max(quantize.QP_MIN, min(quantize.QP_MAX, t_qp))
    for name in unused:  # (e.g. a pooler the task never reads): the coarsest step the cap allows
        out[name] = max(quantize.QP_MIN, min(quantize.QP_MAX, qp + MAX_OCTAVES * per_octave))
    return out


def _float_params(model) -> int:
    from .checkpoint import flatten

    ckpt = model if hasattr(model, "tensors") else flatten(model)
    total = 0
    for t in ckpt.tensors.values():
        total += int(np.prod(tuple(t.shape)))
    return total


def encode_to_size(model, *, target_bytes: int | None = None, target_bpw: float | None = None,
                   qp_range: tuple[int, int] = (-80, 40), **encode_kwargs) -> bytes:
    """The stream of ``model`` closest to a size budget without exceeding it.

    Give ``target_bytes`` or ``target_bpw`` (bits per parameter, all tensors counted). The qp is
    searched first (each step of qp changes the size by a few percent); between the last qp that
    fits and the next finer one, the lambda of the RD quantizer is raised until the stream is within
    1% of the budget (with the ``nearest`` quantizer, within one qp step). Other arguments go to
    :func:`encode_model`. Raises ``ValueError`` if even the coarsest qp of ``qp_range`` is too big.
    """
    from .codec import encode_model

    if (target_bytes is None) == (target_bpw is None):
        raise ValueError("give exactly one of target_bytes and target_bpw")
    if "qp" in encode_kwargs:
        raise ValueError("encode_to_size chooses qp itself; do not pass qp")
    if target_bpw is not None:
        if not (target_bpw > 0 and math.isfinite(target_bpw)):
            raise ValueError(f"target_bpw must be a positive number, got {target_bpw}")
        target_bytes = int(target_bpw * _float_params(model) / 8)
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
        mid = math.sqrt(a * b) if a > 0 else b / 2
        if len(enc(lo, mid)) <= target:
            b = mid
        else:
            a = mid
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
    from .codec import decode_model, encode_model

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
