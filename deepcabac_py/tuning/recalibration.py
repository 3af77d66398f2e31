"""BatchNorm statistics re-estimated for the quantized weights, on a few calibration inputs.

Quantizing the weights shifts and scales what each BatchNorm receives, and the statistics it
normalizes with can follow. Run layer by layer in forward order, :func:`recalibrate` moves each
layer's running mean by half the shift of its input's mean and scales its running variance by the
change of its input's variance (both measured on the inputs, original against quantized weights,
with the earlier layers already corrected). :func:`encode_recalibrated` encodes, decodes,
recalibrates and encodes again; the weights' levels do not change. Measured on EfficientNet-Lite0
with Fisher importance in ``docs/benchmarks.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..model.batchnorm import TENSORS, batchnorm_modules, epsilons
from ..model.decoder import decode_model
from ..model.encoder import encode_model

# Half of the measured mean shift: the calibration inputs are few and need not look like the inputs
# that matter, and the full shift measured worse on EfficientNet-Lite0 at most rates.
MEAN_SHIFT = 0.5
# Variance ratios are taken with this fraction of the running variance added to both sides, so a
# channel that is (nearly) constant on the calibration inputs keeps its variance.
VAR_FLOOR = 1e-2


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

    bns = batchnorm_modules(model)
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
