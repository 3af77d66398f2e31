"""BatchNorm layers as the encoder sees them: running statistics coded coarsely at no cost in
fidelity.

In eval mode a BatchNorm maps each channel affinely: ``y = a * x + b`` with
``a = gamma / sqrt(var + eps)`` and ``b = beta - a * mean``. Its four tensors carry two numbers per
channel, so the statistics need not be coded finely: :func:`compensate` takes them as the stream
will carry them (``mean'``, ``var'``) and returns ``gamma' = a * sqrt(var' + eps)`` and
``beta' = b + a * (mean' - mean)``, which give back the same ``a`` and ``b``. The decoded layer
computes the same function (up to the quantization error of ``gamma'`` and ``beta'``, coded as
before). The statistics then matter only where training resumes (``gamma'`` and ``beta'`` stay close
to the originals while they do), so their step follows the layer instead of ``qp``
(:func:`statistics_qps`).
``encode_model(batchnorm_eps=...)`` does this; a state dict does not record ``eps``, so the caller
gives it (:func:`epsilons` reads it from a torch model). Re-estimating the statistics with data
is a workflow around the encoder: :mod:`deepcabac_py.tuning.recalibration`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..quant.steps import QP_MAX, step_from_qp

# A BatchNorm layer's float tensors in a state dict, and its running statistics among them.
TENSORS = ("weight", "bias", "running_mean", "running_var")
STATISTICS = ("running_mean", "running_var")
# The precision of coded statistics, relative to a typical channel of their layer. They do not change
# what the layer computes in eval mode (weight and bias compensate), only the point training would
# resume from: about 1% of a typical standard deviation keeps that within the quantization error of
# the weights, and costs about half the bits of the step of qp on EfficientNet-Lite0.
STAT_PRECISION = 1.0 / 32


def check_eps(batchnorm_eps) -> float | dict[str, float] | None:
    """``batchnorm_eps`` as given to ``encode_model``: None, one eps for every BatchNorm, or a
    mapping of module names (``"features.1"``) to their eps. Raises ValueError/TypeError."""
    if batchnorm_eps is None:
        return None
    if isinstance(batchnorm_eps, Mapping):
        out = {}
        for name, eps in batchnorm_eps.items():
            if not isinstance(name, str):
                raise TypeError(f"batchnorm_eps keys must be module names, got {name!r}")
            out[name] = _check_one(eps, name)
        return out
    return _check_one(batchnorm_eps, None)


def _check_one(eps, name) -> float:
    where = f" for {name}" if name else ""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0.0 < float(eps) < math.inf):
        raise ValueError(f"batchnorm_eps{where} must be a finite number > 0, got {eps!r}")
    return float(eps)


def eps_of(module: str, batchnorm_eps: float | Mapping[str, float]) -> float | None:
    if isinstance(batchnorm_eps, Mapping):
        return batchnorm_eps.get(module)
    return batchnorm_eps


def groups(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Module names with 1-D ``weight``, ``bias``, ``running_mean`` and ``running_var`` of one length."""
    found = []
    for name, a in arrays.items():
        if not name.endswith(".running_var") or a.ndim != 1:
            continue
        module = name[: -len(".running_var")]
        parts = [arrays.get(f"{module}.{s}") for s in TENSORS]
        if all(p is not None and p.ndim == 1 and p.shape == a.shape for p in parts):
            found.append(module)
    return found


def compensate(gamma, beta, mean, var, mean_coded, var_coded, eps: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``(gamma', beta')`` that give the eval-mode map of ``(gamma, beta, mean, var)`` with the
    statistics ``(mean_coded, var_coded)`` instead, in float64; None if that is not possible (a
    variance that is negative or not finite)."""
    g, b, m, v, mc, vc = (np.asarray(x, dtype=np.float64) for x in (gamma, beta, mean, var, mean_coded, var_coded))
    if not (np.isfinite(v).all() and np.isfinite(vc).all() and (v > -eps).all() and (vc > -eps).all()):
        return None
    a = g / np.sqrt(v + eps)
    gamma_new = a * np.sqrt(vc + eps)
    beta_new = b + a * (mc - m)
    if not (np.isfinite(gamma_new).all() and np.isfinite(beta_new).all()):
        return None
    return gamma_new, beta_new


def statistics_qps(mean, var, eps: float, qp: int, qp_density: int = 2) -> tuple[int, int]:
    """The qps at which ``running_mean`` and ``running_var`` of one layer are coded: steps of about
    ``STAT_PRECISION`` of the layer's median standard deviation (mean) and twice that of its median
    variance (the relative error of a standard deviation is half its variance's), never finer than
    ``qp``. Only finite values count; a layer without any gets ``qp``."""
    v = np.asarray(var, dtype=np.float64)
    m = np.asarray(mean, dtype=np.float64)
    v = v[np.isfinite(v) & (v > -eps)] + eps
    if v.size == 0 or not np.isfinite(m).all():
        return qp, qp
    typical_var = float(np.median(v))
    return (_coarsest_qp(STAT_PRECISION * math.sqrt(typical_var), qp, qp_density),
            _coarsest_qp(2.0 * STAT_PRECISION * typical_var, qp, qp_density))


def _coarsest_qp(step: float, qp: int, qp_density: int) -> int:
    """The largest qp >= ``qp`` whose step is at most ``step`` (``qp`` if there is none)."""
    best = qp
    if math.isfinite(step):
        try:
            while best < QP_MAX and step_from_qp(best + 1, qp_density) <= step:
                best += 1
        except ValueError:  # the next step leaves float64
            pass
    return best


def epsilons(model) -> dict[str, float]:
    """``{module name: eps}`` of every BatchNorm layer of a ``torch.nn.Module`` that keeps running
    statistics."""
    return {name: float(m.eps) for name, m in batchnorm_modules(model)}


def batchnorm_modules(model) -> list:
    """(name, module) of the BatchNorm layers that keep running statistics (the others normalize
    with each batch's own, and their state dict holds none)."""
    import torch

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_var is not None]
