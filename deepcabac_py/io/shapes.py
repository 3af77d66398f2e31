"""The shapes this library holds: what numpy can allocate, and what both stream formats describe."""

from __future__ import annotations

import math

MAX_NDIM = 32
MAX_DIM = 1 << 48  # any dimension, and the product of the nonzero ones


def shape_problem(shape: tuple[int, ...]) -> str | None:
    """Why a tensor of ``shape`` cannot be held (None if it can)."""
    if len(shape) > MAX_NDIM:
        return f"{len(shape)} dimensions (at most {MAX_NDIM})"
    if not shape:
        return None
    least = min(shape)
    if least < 0:
        return f"a negative dimension in {tuple(shape)}"
    if max(shape) > MAX_DIM:
        return f"a dimension above 2**48 in {tuple(shape)}"
    # (numpy refuses a shape whose nonzero dimensions overflow, even with a zero among them)
    if math.prod(shape if least else (max(d, 1) for d in shape)) > MAX_DIM:
        return f"dimensions that multiply to more than 2**48 in {tuple(shape)}"
    return None
