"""Data-free importance: what a checkpoint's own structure says about where errors hurt.

Without calibration data, two facts in the weights themselves still tell the quantizer where an
error costs more than elsewhere (``encode_model(importance="structural")``, the default):

* **Lookup tables.** An embedding matrix is read one row per token: an error in a row matters only
  when its token occurs, so with no knowledge of token frequencies a weight of a table with ``R``
  rows is worth ``1/R`` of a weight of a dense layer, which every input uses. Tied tables (an
  embedding that is also the output projection) are used densely and get no such discount.
* **Convolutions and linear layers followed by BatchNorm.** BN multiplies output channel ``c`` by
  ``gamma_c / sqrt(running_var_c + eps)``, so an error in a weight of that channel reaches the
  network scaled by that factor. The layer's input is the previous BN's output after a ReLU-family
  activation; with the pre-activation of channel ``j`` distributed as ``N(beta_j, gamma_j**2)``,
  an error in a weight reading channel ``j`` grows with ``E[relu(z_j)**2]``. The importance of
  weight ``(c, j, ...)`` is the product of the two (depthwise convolutions read channel ``c``).
* **The BN's own parameters and the layers' biases**, in the same units (the error of the BN's
  output ``y = gamma * xhat + beta``, ``xhat`` of unit variance): ``beta`` and ``gamma`` weigh 1,
  ``running_mean`` and the preceding layer's bias ``gamma**2 / (var + eps)``, ``running_var``
  ``gamma**2 * var / (4 * (var + eps)**3)``; the bias of a layer without BN after it weighs 1.

The same assumption says how a layer's quantization error moves its outputs on average: an error
``dW`` in a layer reading channel ``j`` of ``relu(N(beta_j, gamma_j**2))`` shifts output channel ``c``
by ``sum_j dW[c, j, taps] * E[relu(z_j)]``. :func:`shift_absorbers` names, per layer, the tensor
that can take that shift out (the running mean of the BN after it, or the layer's own bias), and
``encode_model(bias_correction=True)``, the default, moves it there once the layer is quantized
(data-free bias correction, as in Nagel et al., "Data-Free Quantization Through Weight Equalization
and Bias Correction").

Tensors with two or more dimensions that no rule applies to have importance 1, and the BN-derived
importances are scaled to a geometric mean of 1 over their layers, so ``qp`` keeps its meaning for
ordinary layers. Other one-dimensional tensors (LayerNorm, biases without BN) keep ``qp_1d``.
What this gains on MiniLM, EfficientNet-Lite0 and the digits CNN: ``docs/design-notes.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..io.checkpoint import Checkpoint, flatten, tensor_to_numpy
from ..io.dtypes import FLOAT_NAMES, bfloat16_to_float32
from ..io.tensor_source import CheckpointSource, TensorSource
from .batchnorm import TENSORS as BN_STATS
from .batchnorm import groups as batchnorm_groups

BN_EPS = 1e-3  # as TF-trained nets (EfficientNet) use; also caps the gain of near-dead channels
FLOAT32_CAP = float(np.finfo(np.float32).max) / 4
# A module whose name says it is an embedding table (word, position, token type, patch codebooks).
_EMBEDDING_NAME = re.compile(r"(^|[._])(embed\w*|wte|wpe|tok_embeddings?)$", re.IGNORECASE)
# The rules read the values of one-dimensional tensors only (BatchNorm parameters, biases) and the
# shapes of the others, so a model streamed from disk is planned without loading its matrices.
# A one-dimensional tensor longer than this is no BatchNorm's: the rules leave it out.
RULE_VECTOR_MAX = 1 << 24


def structural_importance(model: Mapping[str, Any] | Checkpoint | TensorSource, *,
                          arrays: Mapping[str, np.ndarray] | None = None) -> dict[str, float | np.ndarray]:
    """Importance of every float tensor with two or more dimensions, and of BatchNorm parameters and
    the biases of BN-scaled layers, from the model's structure.

    Returns ``name -> float`` (uniform within the tensor) or ``name -> float32 array`` of the
    tensor's shape (a read-only broadcast view of per-channel values for the layers), ready for
    ``encode_model(importance=...)``.
    """
    source = _source(model)
    if arrays is None:  # (``arrays``: :func:`rule_arrays` of the model, when the caller has them)
        arrays = rule_arrays(source)
    out: dict[str, float | np.ndarray] = {}
    ruled: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    ruled_1d: dict[str, np.ndarray] = {}
    for module in _finite_batchnorms(arrays):
        ruled_1d.update(_bn_parameter_importance(arrays, module))
    for name, module, following, previous_bn in _layer_chain(arrays, set(source.aliases.values())):
        w = arrays[name]
        if previous_bn is _EMBEDDING:
            out[name] = 1.0 / w.shape[0]
            continue
        gain = _bn_gain(arrays, following) if following else None
        energy = None
        if previous_bn is not None:
            e = _relu_energy(arrays, previous_bn)
            depthwise = _reads_per_channel(w, e.size)
            if depthwise or e.size == w.shape[1]:
                energy = (e, depthwise)
        bias = arrays.get(f"{module}.bias")
        if bias is not None and bias.shape == (w.shape[0],) and (gain is not None or energy is not None):
            # a bias shifts the layer's output: through the BN's scale, or as it is
            ruled_1d[f"{module}.bias"] = gain if gain is not None else np.ones(w.shape[0])
        if gain is None and energy is None:
            out[name] = 1.0
            continue
        # kept as factors (per output channel, per input channel): the (out, in) product is made
        # once, in float32, when it is handed out
        rows = gain if gain is not None else np.ones(w.shape[0])
        cols = np.ones(w.shape[1])
        if energy is not None:
            e, depthwise = energy
            if depthwise:
                rows = rows * e
            else:
                cols = e
        ruled[name] = (rows, cols)

    def product(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return rows[:, None] * cols[None, :]

    # geometric mean 1 over the ruled layers, weighted by size: ordinary layers stay at qp
    means = {n: float(product(*f).mean()) for n, f in ruled.items()}
    logs = [(arrays[n].size, math.log2(m)) for n, m in means.items() if m > 0]
    ref = sum(s * lg for s, lg in logs) / sum(s for s, _ in logs) if logs else 0.0
    scale = 2.0 ** -ref
    for name, factors in ruled.items():
        w = arrays[name]
        # a read-only broadcast view of the (out, in) values over the kernel taps
        small = _as_float32(product(*factors) * scale).reshape(w.shape[:2] + (1,) * (w.ndim - 2))
        out[name] = np.broadcast_to(small, w.shape)
    for name, imp in ruled_1d.items():  # the same units as the layers' (the BN output's error)
        out[name] = _as_float32(imp * scale)
    return out


def shift_absorbers(model: Mapping[str, Any] | Checkpoint | TensorSource, *,
                    arrays: Mapping[str, np.ndarray] | None = None) -> dict[str, tuple[np.ndarray, str]]:
    """Where the expected output shift of each layer's quantization error can be taken out, without
    data: ``layer -> (mean input per input channel, tensor that absorbs the shift)``.

    Under the assumption of :func:`structural_importance` (the layer reads the previous BN's output
    through a ReLU-family activation, channel ``j`` distributed as ``relu(N(beta_j, gamma_j**2))``),
    an error ``dW`` shifts output channel ``c`` by ``sum_j dW[c, j, taps] * E[relu(z_j)]`` on
    average. A BN right after the layer absorbs it in its ``running_mean`` (the shift added); a layer
    without one, in its own ``bias`` (the shift taken off). Layers with no BN before them, or whose
    input channels do not match that BN's, get no entry.
    """
    source = _source(model)
    if arrays is None:  # (``arrays``: :func:`rule_arrays` of the model, when the caller has them)
        arrays = rule_arrays(source)
    out: dict[str, tuple[np.ndarray, str]] = {}
    for name, module, following, previous_bn in _layer_chain(arrays, set(source.aliases.values())):
        if previous_bn is None or previous_bn is _EMBEDDING:
            continue
        w = arrays[name]
        mean_in = _relu_mean(arrays, previous_bn)
        if not (_reads_per_channel(w, mean_in.size) or mean_in.size == w.shape[1]):
            continue
        if following is not None:
            out[name] = (mean_in, f"{following}.running_mean")
        elif arrays.get(f"{module}.bias") is not None and arrays[f"{module}.bias"].shape == (w.shape[0],):
            out[name] = (mean_in, f"{module}.bias")
    return out


def output_shift(weight: np.ndarray, decoded: np.ndarray, mean_in: np.ndarray) -> np.ndarray:
    """The mean shift of every output channel that replacing ``weight`` by ``decoded`` causes on
    inputs of mean ``mean_in`` per channel (float64, one value per output channel)."""
    dw = decoded.astype(np.float64) - weight.astype(np.float64)
    dw = dw.reshape(dw.shape[0], dw.shape[1], -1).sum(axis=2)
    if _reads_per_channel(weight, mean_in.size):  # depthwise: output c reads input c
        return dw[:, 0] * mean_in
    return dw @ mean_in


_EMBEDDING = object()  # what _layer_chain gives as the input BN of a lookup table


def _source(model: Mapping[str, Any] | Checkpoint | TensorSource) -> TensorSource:
    if isinstance(model, TensorSource):
        return model
    return CheckpointSource(model if isinstance(model, Checkpoint) else flatten(model))


def rule_vectors(source: TensorSource) -> dict[str, Any]:
    """The tensors whose values the rules read: the one-dimensional float tensors (BatchNorm
    parameters, biases, norms) up to :data:`RULE_VECTOR_MAX` elements, in checkpoint order."""
    out = {}
    for name in source.names:
        spec = source.spec(name)
        if spec.dtype_name in FLOAT_NAMES and len(spec.shape) <= 1 and 0 < spec.numel <= RULE_VECTOR_MAX:
            out[name] = source.load(name)
    return out


def rule_arrays(source: TensorSource, vectors: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Every float tensor the rules see, in checkpoint order: the values of ``vectors`` (read from
    ``source`` when not given), a stand-in of the right shape (zero strides, no memory) for the
    tensors of two or more dimensions."""
    if vectors is None:
        vectors = rule_vectors(source)
    arrays: dict[str, np.ndarray] = {}
    for name in source.names:
        spec = source.spec(name)
        if name in vectors:
            arr, dtype_name, _ = tensor_to_numpy(vectors[name])
            arrays[name] = bfloat16_to_float32(arr) if dtype_name == "bfloat16" else arr
        elif spec.dtype_name in FLOAT_NAMES and len(spec.shape) >= 2 and spec.numel:
            arrays[name] = np.broadcast_to(np.float32(0.0), spec.shape)
    return arrays


def _finite_batchnorms(arrays: Mapping[str, np.ndarray]) -> list[str]:
    # a BN whose statistics are not finite (a damaged or odd checkpoint) gives no rule
    return [m for m in batchnorm_groups(arrays) if all(np.isfinite(arrays[f"{m}.{s}"]).all() for s in BN_STATS)]


def _layer_chain(arrays: Mapping[str, np.ndarray], tied: set[str]):
    """(name, module, the BN after it or None, the BN before it or None, or _EMBEDDING for a lookup
    table) for every tensor with two or more dimensions, in checkpoint order."""
    layers = [n for n, a in arrays.items() if a.ndim >= 2]
    bn = _finite_batchnorms(arrays)
    order = {n: i for i, n in enumerate(arrays)}
    previous_bn: str | None = None
    for i, name in enumerate(layers):
        w = arrays[name]
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if _EMBEDDING_NAME.search(module) and w.ndim == 2 and name not in tied:
            previous_bn = None
            yield name, module, None, _EMBEDDING
            continue
        following = _following_bn(name, w.shape[0], layers[i + 1] if i + 1 < len(layers) else None, arrays, bn,
                                  order)
        yield name, module, following, previous_bn
        previous_bn = following


def _reads_per_channel(w: np.ndarray, channels: int) -> bool:
    """A depthwise convolution: one input channel per output, as many as the input has."""
    return w.ndim > 2 and w.shape[1] == 1 and channels == w.shape[0]


def _as_float32(x: np.ndarray) -> np.ndarray:
    # odd statistics (gamma ~ 1e38, var ~ 0) can exceed float32: an importance must stay finite
    return np.ascontiguousarray(np.minimum(x, FLOAT32_CAP), dtype=np.float32)


def _bn_parameter_importance(arrays: Mapping[str, np.ndarray], module: str) -> dict[str, np.ndarray]:
    """Error weights of a BN's own parameters, in units of its output's error (y = gamma * xhat + beta,
    xhat = (x - mean) / sqrt(var + eps) of unit variance)."""
    gamma = arrays[f"{module}.weight"].astype(np.float64)
    var = np.maximum(arrays[f"{module}.running_var"].astype(np.float64), 0.0)
    one = np.ones_like(gamma)
    return {f"{module}.weight": one, f"{module}.bias": one,
            f"{module}.running_mean": gamma * gamma / (var + BN_EPS),
            # d y / d var = -gamma (x - mean) / (2 (var + eps)^1.5), E[(x - mean)^2] = var
            f"{module}.running_var": gamma * gamma * var / (4.0 * (var + BN_EPS) ** 3)}


def _following_bn(name: str, channels: int, next_layer: str | None, arrays: Mapping[str, np.ndarray],
                  bn: list[str], order: Mapping[str, int]) -> str | None:
    """The BN right after layer ``name`` (before the next layer) in the same parent module, with one
    channel per output of the layer."""
    parent = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
    lo = order[name]
    hi = order[next_layer] if next_layer is not None else len(order)
    for module in bn:
        at = order[f"{module}.running_var"]
        same_parent = (module.rsplit(".", 1)[0] if "." in module else "") == parent
        if lo < at < hi and same_parent:
            fits = order[f"{module}.weight"] > lo and arrays[f"{module}.running_var"].shape[0] == channels
            return module if fits else None
    return None


def _bn_gain(arrays: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    gamma = arrays[f"{module}.weight"].astype(np.float64)
    var = np.maximum(arrays[f"{module}.running_var"].astype(np.float64), 0.0)
    return gamma * gamma / (var + BN_EPS)


def _relu_energy(arrays: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    """E[relu(z)**2] for z ~ N(beta, gamma**2), per channel of the BN ``module``'s output."""
    # a dead channel (relu(z) ~ 0 always) has energy ~0: the weights reading it do not matter
    return _relu_moments(arrays, module)[1]


def _relu_mean(arrays: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    """E[relu(z)] for z ~ N(beta, gamma**2), per channel of the BN ``module``'s output."""
    return _relu_moments(arrays, module)[0]


def _relu_moments(arrays: Mapping[str, np.ndarray], module: str) -> tuple[np.ndarray, np.ndarray]:
    mu = arrays[f"{module}.bias"].astype(np.float64)
    sigma = np.maximum(np.abs(arrays[f"{module}.weight"].astype(np.float64)), 1e-30)
    a = np.clip(mu / sigma, -40.0, 40.0)
    cdf = 0.5 * (1.0 + _erf(a / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    return (np.maximum(mu * cdf + sigma * pdf, 0.0),
            np.maximum((mu * mu + sigma * sigma) * cdf + mu * sigma * pdf, 0.0))


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)
