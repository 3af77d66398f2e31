"""BatchNorm layers: running statistics coded coarsely at no cost in fidelity, and statistics
re-estimated for the quantized weights.

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
gives it (:func:`epsilons` reads it from a torch model).

:func:`recalibrate` uses a few calibration inputs: quantizing the weights shifts and scales what
each BatchNorm receives, and the statistics it normalizes with can follow. Run layer by layer in
forward order, it moves each layer's running mean by half the shift of its input's mean and scales
its running variance by the change of its input's variance (both measured on the inputs, original
against quantized weights, with the earlier layers already corrected). :func:`encode_recalibrated`
encodes, decodes, recalibrates and encodes again; the weights' levels do not change.
Measured on EfficientNet-Lite0 (``benchmarks/bench_rd.py``, Fisher importance): see the README.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .structure import BN_STATS, _batchnorm_groups

TENSORS = BN_STATS  # a BatchNorm layer's float tensors in a state dict
STATISTICS = ("running_mean", "running_var")
# Half of the measured mean shift: the calibration inputs are few and need not look like the inputs
# that matter, and the full shift measured worse on EfficientNet-Lite0 at most rates.
MEAN_SHIFT = 0.5
# Variance ratios are taken with this fraction of the running variance added to both sides, so a
# channel that is (nearly) constant on the calibration inputs keeps its variance.
VAR_FLOOR = 1e-2
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
    return _batchnorm_groups(arrays)


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
    from .quantize import QP_MAX, step_from_qp

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
    return {name: float(m.eps) for name, m in _batchnorms(model)}


def _batchnorms(model) -> list:
    """(name, module) of the BatchNorm layers that keep running statistics (the others normalize
    with each batch's own, and their state dict holds none)."""
    import torch

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_var is not None]


def recalibrate(model, original: Mapping[str, Any], quantized: Mapping[str, Any], inputs) -> dict[str, np.ndarray]:
    """Running statistics for the BatchNorm layers of ``model`` loaded with the ``quantized`` state
    dict, re-estimated on ``inputs`` (a tensor passed to ``model`` as one batch, or an iterable of
    tensors, concatenated into one).

    ``original`` is the state dict the quantized one was made from. Returns ``{name: float32 array}``
    for every ``running_mean`` and ``running_var``, to go with the original BatchNorm ``weight`` and
    ``bias``; the model is left holding the quantized weights with those BatchNorm parameters. The
    model runs in eval mode and without gradients.
    """
    import torch

    bns = _batchnorms(model)
    if not bns:
        raise ValueError("the model has no BatchNorm layers")
    if not isinstance(inputs, torch.Tensor):
        parts = list(inputs)
        if not parts:
            raise ValueError("no calibration inputs")
        inputs = torch.cat(parts)
    was_training = model.training
    model.eval()
    try:
        _load(model, original)
        reference: dict[str, tuple] = {}
        _run_with_hooks(model, bns, inputs, lambda name, m, x: reference.__setitem__(name, _moments(x)))
        missing = [name for name, _ in bns if name not in reference]
        if missing:
            raise ValueError(f"BatchNorm layers the inputs do not reach: {', '.join(missing[:5])}")
        # The BatchNorm layers start from their original parameters (the quantized ones may code the
        # same function differently, see compensate), so the new statistics go with those.
        mixed = dict(quantized)
        for name, _ in bns:
            for suffix in TENSORS:
                key = f"{name}.{suffix}"
                if key in original:
                    mixed[key] = original[key]
        _load(model, mixed)
        out: dict[str, np.ndarray] = {}

        # One pass: a layer's hook runs before the layer, after every earlier layer has been
        # corrected, so it sees the inputs the corrected network gives it.
        def correct(name, m, x):
            mean_q, var_q = _moments(x)
            mean_o, var_o = reference[name]
            rm = m.running_mean.detach().double()
            rv = m.running_var.detach().double()
            floor = VAR_FLOOR * rv.clamp_min(0) + 1e-12
            rm = rm + MEAN_SHIFT * (mean_q - mean_o)
            rv = rv * (var_q + floor) / (var_o + floor)
            m.running_mean.copy_(rm.to(m.running_mean.dtype))
            m.running_var.copy_(rv.to(m.running_var.dtype))
            out[f"{name}.running_mean"] = rm.float().numpy()
            out[f"{name}.running_var"] = rv.float().numpy()

        _run_with_hooks(model, bns, inputs, correct)
        return out
    finally:
        model.train(was_training)


def _run_with_hooks(model, bns, inputs, fn) -> None:
    import torch

    hooks = [m.register_forward_pre_hook(lambda mod, inp, name=name: fn(name, mod, inp[0].detach().double()))
             for name, m in bns]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in hooks:
            h.remove()


def _moments(x) -> tuple:
    """Per-channel mean and variance of a (batch, channels, ...) tensor."""
    dims = [d for d in range(x.dim()) if d != 1]
    mean = x.mean(dims)
    return mean, x.var(dims, unbiased=False)


def _load(model, state: Mapping[str, Any]) -> None:
    import torch

    own = model.state_dict()
    tensors = {}
    for k, v in state.items():
        if k in own:
            t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
            tensors[k] = t.to(own[k].dtype)
    missing = sorted(set(own) - set(tensors))
    if missing:
        raise ValueError(f"the state dict lacks tensors of the model: {', '.join(missing[:5])}")
    model.load_state_dict(tensors, strict=True)


def recalibrated_state(model, inputs, *, state: Mapping[str, Any] | None = None,
                       batchnorm_eps: float | Mapping[str, float] | None = None, **encode_kwargs) -> dict[str, Any]:
    """``state`` (default: ``model.state_dict()``, as numpy arrays) with its BatchNorm statistics
    recalibrated on ``inputs`` for the weights as ``encode_model(state, **encode_kwargs)`` quantizes
    them (see :func:`recalibrate`). The model is given back holding ``state``. Encode it with
    ``bias_correction=False``: its statistics already follow the measured shifts (the data-free
    estimate on top took them out twice: 1.3-2.3x the mean KL on EfficientNet-Lite0)."""
    from .codec import decode_model, encode_model

    encode_kwargs.setdefault("bias_correction", False)
    if state is None:
        state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    first = encode_model(state, batchnorm_eps=batchnorm_eps, **encode_kwargs)
    decoded = decode_model(first, threads=encode_kwargs.get("threads"))
    stats = recalibrate(model, state, decoded, inputs)
    _load(model, state)
    return {**state, **{name: _like(state[name], value) for name, value in stats.items()}}


def encode_recalibrated(model, inputs, *, state: Mapping[str, Any] | None = None,
                        batchnorm_eps: float | Mapping[str, float] | None = None, **encode_kwargs) -> bytes:
    """Encode ``state`` (default: ``model.state_dict()``) with its BatchNorm statistics recalibrated
    for the quantized weights on ``inputs`` (:func:`recalibrated_state`, then
    :func:`deepcabac_py.encode_model`; the weights' levels are those of a plain encode).
    ``batchnorm_eps`` defaults to the model's (:func:`epsilons`); other keyword arguments go to
    ``encode_model`` (``bias_correction`` defaults to False: the statistics are measured instead).
    """
    from .codec import encode_model

    encode_kwargs.setdefault("bias_correction", False)
    if batchnorm_eps is None:
        batchnorm_eps = epsilons(model)
    state2 = recalibrated_state(model, inputs, state=state, batchnorm_eps=batchnorm_eps, **encode_kwargs)
    return encode_model(state2, batchnorm_eps=batchnorm_eps, **encode_kwargs)


def _like(reference, value: np.ndarray):
    """``value`` as the kind (torch or numpy) and dtype of ``reference``."""
    import torch

    if isinstance(reference, torch.Tensor):
        return torch.from_numpy(np.ascontiguousarray(value)).to(reference.dtype)
    return np.asarray(value).astype(np.asarray(reference).dtype)
