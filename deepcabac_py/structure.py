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
  ``gamma**2 * var / (4 * (var + eps)**3)``; the bias of a layer without BN after it weighs 1. Until
  now these one-dimensional tensors took a step 6 octaves finer than the weights' whatever they did.

Tensors with two or more dimensions that no rule applies to have importance 1, and the BN-derived
importances are scaled to a geometric mean of 1 over their layers, so ``qp`` keeps its meaning for
ordinary layers. Other one-dimensional tensors (LayerNorm, biases without BN) keep ``qp_1d``.
Measured with ``benchmarks/bench_rd.py`` (bytes at equal fidelity against ``importance=None``, the
trellis in both): all-MiniLM-L6-v2 9% fewer at embedding cosine 0.999 and 10% at 0.994 (the word
embedding, half the weights, takes a step 3 octaves coarser); EfficientNet-Lite0 4% fewer at mean KL
2.5e-3 and 9% at 1e-2 (its one-dimensional tensors drop from about 15.5 to 9 bits each). On the
project's own digits CNN the KL at equal bytes is lower at 3 of the 4 usable qps.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .checkpoint import Checkpoint, flatten, tensor_to_numpy

BN_EPS = 1e-3  # as TF-trained nets (EfficientNet) use; also caps the gain of near-dead channels
BN_STATS = ("weight", "bias", "running_mean", "running_var")
FLOAT32_CAP = float(np.finfo(np.float32).max) / 4
# A module whose name says it is an embedding table (word, position, token type, patch codebooks).
_EMBEDDING_NAME = re.compile(r"(^|[._])(embed\w*|wte|wpe|tok_embeddings?)$", re.IGNORECASE)


def structural_importance(model: Mapping[str, Any] | Checkpoint) -> dict[str, float | np.ndarray]:
    """Importance of every float tensor with two or more dimensions, and of BatchNorm parameters and
    the biases of BN-scaled layers, from the model's structure.

    Returns ``name -> float`` (uniform within the tensor) or ``name -> float32 array`` of the
    tensor's shape (a read-only broadcast view of per-channel values for the layers), ready for
    ``encode_model(importance=...)``.
    """
    ckpt = model if isinstance(model, Checkpoint) else flatten(model)
    arrays: dict[str, np.ndarray] = {}
    for name, t in ckpt.tensors.items():
        arr, dtype_name, _ = tensor_to_numpy(t)
        if dtype_name == "bfloat16":  # carried as its 16-bit patterns
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        if dtype_name.startswith(("float", "bfloat")) and arr.size:
            arrays[name] = arr
    tied = set(ckpt.aliases.values())

    out: dict[str, float | np.ndarray] = {}
    layers = [n for n, a in arrays.items() if a.ndim >= 2]
    # a BN whose statistics are not finite (a damaged or odd checkpoint) gives no rule
    bn = [m for m in _batchnorm_groups(arrays)
          if all(np.isfinite(arrays[f"{m}.{s}"]).all() for s in BN_STATS)]
    ruled: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    ruled_1d: dict[str, np.ndarray] = {}
    for module in bn:
        ruled_1d.update(_bn_parameter_importance(arrays, module))
    previous_bn: str | None = None
    order = {n: i for i, n in enumerate(arrays)}
    for i, name in enumerate(layers):
        w = arrays[name]
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if _EMBEDDING_NAME.search(module) and w.ndim == 2 and name not in tied:
            out[name] = 1.0 / w.shape[0]
            previous_bn = None
            continue
        following = _following_bn(name, w.shape[0], layers[i + 1] if i + 1 < len(layers) else None, arrays, bn,
                                  order)
        gain = _bn_gain(arrays, following) if following else None
        energy = None
        if previous_bn is not None:
            e = _relu_energy(arrays, previous_bn)
            depthwise = w.ndim > 2 and w.shape[1] == 1 and e.size == w.shape[0]
            if depthwise or e.size == w.shape[1]:
                energy = (e, depthwise)
        previous_bn = following
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


def _batchnorm_groups(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Module names with 1-D ``weight``, ``bias``, ``running_mean`` and ``running_var`` of one length."""
    groups = []
    for name, a in arrays.items():
        if not name.endswith(".running_var") or a.ndim != 1:
            continue
        module = name[: -len(".running_var")]
        parts = [arrays.get(f"{module}.{s}") for s in BN_STATS]
        if all(p is not None and p.ndim == 1 and p.shape == a.shape for p in parts):
            groups.append(module)
    return groups


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
    mu = arrays[f"{module}.bias"].astype(np.float64)
    sigma = np.maximum(np.abs(arrays[f"{module}.weight"].astype(np.float64)), 1e-30)
    a = np.clip(mu / sigma, -40.0, 40.0)
    cdf = 0.5 * (1.0 + _erf(a / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    # a dead channel (relu(z) ~ 0 always) has energy ~0: the weights reading it do not matter
    return np.maximum((mu * mu + sigma * sigma) * cdf + mu * sigma * pdf, 0.0)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)
