"""Sparsifiers for weight updates and the error-feedback accumulator.

Every sparsifier maps a dense float tensor (``torch.Tensor`` or ``numpy.ndarray``) to a
:class:`SparseTensor`: integer ``levels`` of the tensor's shape and one float ``step``, such that the
update that is *sent* is ``levels * step`` (computed in float32). The levels are what the update
coders (:mod:`deepcabac_py.updates.golomb`, :mod:`deepcabac_py.updates.messages`) code; the step travels as one
float32 per tensor.

* :func:`topk_mask`: the ``k = ceil(density * numel)`` largest magnitudes, exactly
  (``numpy.argpartition``) or from a sampled threshold for large tensors (falls back to exact when
  the sample misses the target count by more than a factor of 2).
* :func:`stc`: Sparse Ternary Compression (Sattler et al. 2019): top-k, then every kept value is
  replaced by +/- the mean kept magnitude. Levels in {-1, 0, +1}.
* :func:`sbc`: Sparse Binary Compression (Sattler et al. 2018): top-k among the positive and among
  the negative entries separately; only the side with the larger mean magnitude is kept, all equal
  to that mean. Levels in {0, +1} or {0, -1}: no sign is sent.
* :func:`topk_quantized`: top-k with the kept values on a uniform grid of ``value_levels`` steps.
* :func:`structured_rows`: zero whole rows (output channels, dim 0) with the smallest mean
  magnitude; combine with any of the above through ``rows=`` of :func:`sparsify`.
* :class:`ErrorFeedback`: residual = what was meant minus what was sent, added to the next update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("stc", "sbc", "topk")
SAMPLED_MIN_NUMEL = 1 << 20  # below this, "auto" uses the exact top-k


@dataclass
class SparseTensor:
    """A sparse update of one tensor: the values sent are ``levels * step`` (float32)."""

    levels: np.ndarray  # int32, the tensor's shape
    step: float  # a float32 value (exactly representable)
    method: str = "stc"

    @property
    def nnz(self) -> int:
        return int(np.count_nonzero(self.levels))

    def values(self) -> np.ndarray:
        """The dense float32 update this sparse tensor stands for."""
        return reconstruct(self.levels, self.step)


def reconstruct(levels: np.ndarray, step: float) -> np.ndarray:
    """``levels * step`` in float32: the one reconstruction rule both ends use."""
    return levels.astype(np.float32) * np.float32(step)


def _as_numpy(x) -> tuple[np.ndarray, bool]:
    import torch  # (a dependency; imported here so that numpy-only callers do not pay for it)

    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float32).numpy(), True
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise TypeError(f"sparsifiers take float tensors, got dtype {x.dtype}")
        return x, False
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _check_density(density: float) -> None:
    if not (isinstance(density, (int, float)) and 0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")


def keep_count(numel: int, density: float) -> int:
    """``k = ceil(density * numel)`` (at least 1 for a non-empty tensor)."""
    _check_density(density)
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(float(density) * numel - 1e-9)))


def topk_mask(x, density: float, *, sampled: bool | str = "auto", seed: int = 0) -> np.ndarray:
    """Boolean mask of the ``ceil(density * numel)`` largest ``|x|`` (ties broken by position).

    ``sampled=True`` estimates the threshold from a random sample of at least ``100 / density``
    elements (the kept count is then close to, not exactly, k); ``"auto"`` samples only tensors of
    at least 2**20 elements. Zeros are never kept.
    """
    arr, _ = _as_numpy(x)
    flat = np.abs(arr.reshape(-1))
    k = keep_count(flat.size, density)
    mask = np.zeros(flat.size, dtype=bool)
    if k == 0:
        return mask.reshape(arr.shape)
    if sampled == "auto":
        sampled = flat.size >= SAMPLED_MIN_NUMEL
    if sampled and k < flat.size:
        m = min(flat.size, max(int(math.ceil(100.0 / density)), flat.size // 100))
        rng = np.random.default_rng(seed)
        sample = flat[rng.integers(0, flat.size, size=m)]
        thr = np.partition(sample, m - max(1, int(round(m * density))))[m - max(1, int(round(m * density)))]
        if thr > 0:
            mask = flat >= thr
            count = int(mask.sum())
            if k / 2 <= count <= 2 * k:
                return mask.reshape(arr.shape)
        mask[:] = False
    if k >= flat.size:
        idx = np.arange(flat.size)
    else:
        # Stable tie-break: among equal magnitudes the lower index wins.
        idx = np.argpartition(-flat, k - 1, kind="introselect")[:k]
        thr = flat[idx].min()
        above = np.flatnonzero(flat > thr)
        ties = np.flatnonzero(flat == thr)[: k - above.size]
        idx = np.concatenate([above, ties])
    mask[idx] = True
    mask &= flat > 0
    return mask.reshape(arr.shape)


def _f32(x: float) -> float:
    return float(np.float32(x))


def stc(x, density: float, *, sampled: bool | str = "auto", mask: np.ndarray | None = None) -> SparseTensor:
    """Sparse Ternary Compression: top-k, every kept value set to +/- the mean kept magnitude."""
    arr, _ = _as_numpy(x)
    if mask is None:
        mask = topk_mask(arr, density, sampled=sampled)
    levels = np.zeros(arr.shape, dtype=np.int32)
    if not mask.any():
        return SparseTensor(levels, 0.0, "stc")
    kept = arr[mask].astype(np.float64)
    mu = _f32(np.abs(kept).mean())
    if mu == 0.0:
        return SparseTensor(levels, 0.0, "stc")
    levels[mask] = np.where(kept > 0, 1, -1)
    return SparseTensor(levels, mu, "stc")


def sbc(x, density: float, *, allowed: np.ndarray | None = None) -> SparseTensor:
    """Sparse Binary Compression: the positive and the negative top-k sets; keep the side with the
    larger mean magnitude, every kept value equal to that mean (levels all +1 or all -1)."""
    arr, _ = _as_numpy(x)
    flat = arr.reshape(-1).astype(np.float64)
    if allowed is not None:
        flat = np.where(allowed.reshape(-1), flat, 0.0)
    levels = np.zeros(flat.size, dtype=np.int32)
    k = keep_count(flat.size, density)
    best: tuple[float, int, np.ndarray | None] = (0.0, 0, None)
    for sign in (1, -1):
        side = np.maximum(sign * flat, 0.0)
        m = topk_mask(side, min(1.0, k / max(1, flat.size)) if flat.size else 1.0, sampled=False).reshape(-1)
        if m.any():
            mu = float(side[m].mean())
            if mu > best[0]:
                best = (mu, sign, m)
    mu, sign, chosen = best
    if chosen is None or _f32(mu) == 0.0:
        return SparseTensor(levels.reshape(arr.shape), 0.0, "sbc")
    levels[chosen] = sign
    return SparseTensor(levels.reshape(arr.shape), _f32(mu), "sbc")


def topk_quantized(x, density: float, *, value_levels: int = 7, sampled: bool | str = "auto",
                   mask: np.ndarray | None = None) -> SparseTensor:
    """Top-k with the kept values on a uniform grid: ``step = max|kept| / value_levels``."""
    if not (isinstance(value_levels, int) and 1 <= value_levels <= (1 << 20)):
        raise ValueError(f"value_levels must be an integer in [1, 2**20], got {value_levels!r}")
    arr, _ = _as_numpy(x)
    if mask is None:
        mask = topk_mask(arr, density, sampled=sampled)
    levels = np.zeros(arr.shape, dtype=np.int32)
    if not mask.any():
        return SparseTensor(levels, 0.0, "topk")
    kept = arr[mask].astype(np.float64)
    step = _f32(np.abs(kept).max() / value_levels)
    if step == 0.0:
        return SparseTensor(levels, 0.0, "topk")
    levels[mask] = np.clip(np.rint(kept / step), -value_levels, value_levels).astype(np.int32)
    return SparseTensor(levels, step, "topk")


def structured_rows(x, keep: float) -> np.ndarray:
    """Mask of the rows (dim 0; output channels) to keep: the ``ceil(keep * rows)`` rows with the
    largest mean magnitude. Tensors with fewer than two dimensions keep everything."""
    arr, _ = _as_numpy(x)
    _check_density(keep)
    if arr.ndim < 2 or arr.shape[0] < 2:
        return np.ones(arr.shape, dtype=bool)
    rows = arr.shape[0]
    score = np.abs(arr.reshape(rows, -1)).mean(axis=1)
    n = keep_count(rows, keep)
    order = np.argsort(-score, kind="stable")[:n]
    row_mask = np.zeros(rows, dtype=bool)
    row_mask[order] = True
    return np.broadcast_to(row_mask.reshape((rows,) + (1,) * (arr.ndim - 1)), arr.shape).copy()


def sparsify(x, method: str = "stc", density: float = 0.01, *, rows: float | None = None,
             value_levels: int = 7, sampled: bool | str = "auto") -> SparseTensor:
    """Sparsify one dense tensor.

    Parameters
    ----------
    x : torch.Tensor or numpy.ndarray
        The dense update.
    method : {"stc", "sbc", "topk"}
        Sparse ternary, sparse binary, or top-k on a grid of ``value_levels`` steps.
    density : float
        Fraction of all elements kept, in (0, 1].
    rows : float or None
        First restrict the choice to this fraction of the strongest rows.
    value_levels : int
        Grid size of ``"topk"``.
    sampled : bool or "auto"
        Find the top-k threshold from a sample (large tensors) or exactly.

    Returns
    -------
    SparseTensor
        Integer levels of the tensor's shape and one step: what is sent is ``levels * step``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    arr, _ = _as_numpy(x)
    _check_density(density)
    allowed = structured_rows(arr, rows) if rows is not None else None
    if method == "sbc":
        return sbc(arr, density, allowed=allowed)
    src = np.where(allowed, arr, 0) if allowed is not None else arr
    mask = topk_mask(src, density, sampled=sampled)
    if method == "stc":
        return stc(arr, density, mask=mask)
    return topk_quantized(arr, density, value_levels=value_levels, mask=mask)


class ErrorFeedback:
    """Error accumulation: ``A = residual + update``; send ``S = compress(A)``; ``residual = A - S``.

    Residuals are kept in float64, so ``residual + sent == accumulated`` holds to the last bit in
    practice (the test suite checks it). Works per tensor name; tensors may be torch or numpy.
    """

    def __init__(self) -> None:
        self.residual: dict[str, np.ndarray] = {}

    def accumulate(self, update: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``residual + update`` per tensor (float64), without changing the state."""
        out = {}
        for name, value in update.items():
            arr, _ = _as_numpy(value)
            acc = arr.astype(np.float64)
            res = self.residual.get(name)
            if res is not None:
                if res.shape != acc.shape:
                    raise ValueError(f"{name}: update shape {acc.shape} differs from the residual's {res.shape}")
                acc = acc + res
            out[name] = acc
        return out

    def commit(self, accumulated: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray]) -> None:
        """Store ``residual = accumulated - sent`` (``sent`` missing a name means nothing was sent)."""
        for name, acc in accumulated.items():
            s = sent.get(name)
            self.residual[name] = acc - (np.asarray(s, dtype=np.float64) if s is not None else 0.0)

    def step(self, update: Mapping[str, Any], compress: Callable[[str, np.ndarray], SparseTensor]
             ) -> dict[str, SparseTensor]:
        """Accumulate ``update``, compress each tensor with ``compress(name, accumulated)``, keep the
        residual; returns what is sent."""
        acc = self.accumulate(update)
        sent = {name: compress(name, a) for name, a in acc.items()}
        self.commit(acc, {n: s.values() for n, s in sent.items()})
        return sent

    def norm(self) -> float:
        """L2 norm of the residual (for monitoring)."""
        return float(math.sqrt(sum(float(np.square(r).sum()) for r in self.residual.values())))
