"""The integer levels of a tensor and how to turn them back into values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..io.checkpoint import numpy_to_tensor
from ..io.dtypes import DType
from ..quant.reconstruct import dq_indices, reconstruct
from .container import Mode, TensorEntry


@dataclass
class QuantizedTensor:
    """The integer levels of one tensor and how to turn them back into values.

    For quantized floats ``values = levels * step`` (rounded once to ``dtype``); for integer tensors
    ``step`` is ``None`` and the levels are the values. Levels of trellis-coded tensors are their
    reconstruction indices, not the transmitted levels.
    """

    name: str
    levels: np.ndarray  # int32, the tensor's shape
    step: float | None
    dtype: str
    qp: int | None = None
    qp_density: int | None = None

    def dequantize(self) -> Any:
        """The values in the original dtype (a torch tensor for bfloat16, else a numpy array)."""
        if self.step is None:
            return self.levels.astype(DType.from_name(self.dtype).carrier)
        values = reconstruct(self.levels, self.step, self.dtype)
        # numpy has no bfloat16: those come back as a torch tensor
        return numpy_to_tensor(values, self.dtype, True) if self.dtype == "bfloat16" else values

    def decoded64(self) -> np.ndarray:
        """The decoded values of a quantized tensor in float64 (exact: sums for the bias correction)."""
        if self.step is None:
            raise ValueError(f"{self.name!r} holds integers, not quantized values")
        return self.levels.astype(np.float64) * self.step


def quantized(e: TensorEntry, levels: np.ndarray) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a table entry with these levels (reconstruction indices)."""
    uniform = e.mode.is_quantized
    return QuantizedTensor(e.name, levels, e.step, e.dtype.dtype_name,
                           e.qp if uniform else None, e.qp_density if uniform else None)


def assembled(e: TensorEntry, parts: list[np.ndarray]) -> QuantizedTensor:
    """A tensor from the levels of its chunks as the encoder makes them (the trellis's transmitted
    levels become reconstruction indices chunk by chunk: its state restarts with every substream)."""
    if e.mode == Mode.DEPENDENT:
        parts = [dq_indices(part) for part in parts]
    levels = np.concatenate(parts) if len(parts) != 1 else parts[0]
    return quantized(e, levels.reshape(e.shape))
