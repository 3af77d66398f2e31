"""numcodecs / zarr codec: store weight arrays (any numeric array) with deepcabac.

:class:`DeepCabac` is a ``numcodecs.abc.Codec`` registered under the id ``"deepcabac"`` through the
``numcodecs.codecs`` entry point, so ``numcodecs.get_codec({"id": "deepcabac", "step": 1e-3})``
finds it once the package is installed. Each chunk becomes one deepcabac model stream holding one
tensor (``deepcabac info`` reads it):

* float arrays are quantized to the nearest multiple of a step and entropy coded: every decoded
  value is within ``step / 2`` of the original (plus the rounding of the result to the array's
  dtype). ``step=`` names the largest step allowed (the codec uses the largest NNC step that is
  not larger), ``qp=`` an NNC quantization parameter directly;
* integer and boolean arrays are coded losslessly (no setting needed); complex arrays, arrays
  with NaN or infinities and ``keep_exact=True`` are stored exactly.

Decoding needs no setting: the stream names its dtype, shape and step.

With zarr 3, :class:`DeepCabacZarr3` (registered under ``"numcodecs.deepcabac"`` through the
``zarr.codecs`` entry point) is the array-to-bytes codec (``serializer=``); zarr 2 format arrays
take :class:`DeepCabac` as their ``compressor``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ensure_ndarray, ndarray_copy

from ..errors import FormatError
from ..model.decoder import decode_checkpoint, read_stream_header
from ..model.encoder import encode_model
from ..quant.steps import QP_DENSITY_MAX, qp_at_most, qp_for_range, step_from_qp

__all__ = ["DeepCabac", "DeepCabacZarr3"]  # noqa: F822 (DeepCabacZarr3 comes from __getattr__, with zarr)

_TENSOR = "data"  # the one tensor of a chunk's stream
_KINDS = "fiubc"  # numeric dtypes; datetimes are coded as their int64 ticks


class DeepCabac(Codec):
    """deepcabac for numcodecs: nearest-level quantization + CABAC for floats, lossless for integers.

    Parameters
    ----------
    step : float, optional
        Largest quantization step allowed for float data: every value decodes within ``step / 2``.
    qp : int, optional
        NNC quantization parameter (``step = step_from_qp(qp, qp_density)``); instead of ``step``.
    qp_density : int
        Steps per octave are ``2 ** qp_density`` (NNC's ``qp_density``, 0..6).
    keep_exact : bool
        Store floats exactly (no quantization).
    dtype : str, optional
        Read the input's bytes as this dtype (for raw buffers, as numcodecs' ``Quantize``); by
        default arrays keep their own dtype and byte buffers are read as ``uint8``.

    Float data needs ``step``, ``qp`` or ``keep_exact=True``: there is no precision that suits every
    array. Integer data needs nothing.
    """

    codec_id = "deepcabac"

    def __init__(self, step: float | None = None, qp: int | None = None, qp_density: int = 2,
                 keep_exact: bool = False, dtype: str | None = None):
        if step is not None and qp is not None:
            raise ValueError("give either step= or qp=, not both")
        if isinstance(qp_density, bool) or not isinstance(qp_density, int) or not 0 <= qp_density <= QP_DENSITY_MAX:
            raise ValueError(f"qp_density must be an integer in [0, {QP_DENSITY_MAX}], got {qp_density!r}")
        if not isinstance(keep_exact, bool):
            raise TypeError(f"keep_exact must be True or False, got {keep_exact!r}")
        self._qp: int | None
        if step is not None:
            self._qp = qp_at_most(step, qp_density)
        elif qp is not None:
            step_from_qp(qp, qp_density)  # validates
            self._qp = int(qp)
        else:
            self._qp = None
        self.step = float(step) if step is not None else None
        self.qp = int(qp) if qp is not None else None
        self.qp_density = qp_density
        self.keep_exact = keep_exact
        if dtype is not None:
            dt = np.dtype(dtype)
            if dt.kind not in _KINDS + "Mm":
                raise TypeError(f"dtype must be numeric, got {dt}")
            dtype = dt.str
        self.dtype = dtype

    @property
    def effective_step(self) -> float | None:
        """The quantization step float data is coded with (``None`` without ``step``/``qp``)."""
        return step_from_qp(self._qp, self.qp_density) if self._qp is not None else None

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, "step": self.step, "qp": self.qp, "qp_density": self.qp_density,
                "keep_exact": self.keep_exact, "dtype": self.dtype}

    def __repr__(self) -> str:
        params = [f"{k}={v!r}" for k, v in self.get_config().items() if k != "id"]
        return f"{type(self).__name__}({', '.join(params)})"

    def _array(self, buf) -> np.ndarray:
        arr = ensure_ndarray(buf)
        if arr.dtype == object:
            raise TypeError("deepcabac cannot encode object arrays")
        if self.dtype is not None and arr.dtype != np.dtype(self.dtype):
            arr = ensure_contiguous_ndarray(arr).view(self.dtype)
        if arr.dtype.kind in "Mm":
            arr = arr.view(np.int64)
        if arr.dtype.kind not in _KINDS:
            raise TypeError(f"deepcabac encodes numeric arrays, got dtype {arr.dtype}")
        if not arr.flags.c_contiguous:
            # Chunks are decoded in C order: a Fortran-ordered array is coded flat, in its memory
            # order, so that decode(encode(x)) has x's bytes (the numcodecs contract).
            arr = arr.reshape(-1, order="A") if arr.flags.f_contiguous else np.ascontiguousarray(arr)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        return arr

    def encode(self, buf) -> bytes:
        arr = self._array(buf)
        exact = self.keep_exact
        qp = self._qp if self._qp is not None else 0
        if arr.dtype.kind == "f" and not exact and arr.size:
            if self._qp is None:
                raise ValueError("deepcabac: float data needs a precision: DeepCabac(step=...) (largest step "
                                 "allowed), DeepCabac(qp=...) or DeepCabac(keep_exact=True)")
            finite = arr[np.isfinite(arr)]
            top = float(np.abs(finite).max()) if finite.size else 0.0
            # Levels are 31-bit: the library would coarsen the step for values this large, which
            # would break the codec's error bound, so such a chunk is stored exactly instead.
            try:
                exact = qp_for_range(top, qp, self.qp_density) != qp
            except ValueError:
                exact = True
        # Nearest levels: the rate-distortion quantizers move values by more than step / 2. One
        # thread: zarr already encodes chunks in parallel.
        return encode_model({_TENSOR: arr}, qp=qp, qp_1d=qp, qp_density=self.qp_density, keep_exact=exact,
                            quantizer="nearest", threads=1)

    def decode(self, buf, out=None):
        data = ensure_contiguous_ndarray(buf).view(np.uint8)
        header = read_stream_header(data)
        names = [e.name for e in header.tensors]
        if names != [_TENSOR]:
            raise FormatError(f"not a deepcabac array chunk: the stream holds the tensors {names[:5]}")
        values = decode_checkpoint(data, threads=1).tensors[_TENSOR]
        if out is not None:
            if ensure_ndarray(out).dtype == object:
                raise TypeError("deepcabac cannot decode into an object array")
            if ensure_ndarray(out).nbytes != values.nbytes:
                raise ValueError(f"out holds {ensure_ndarray(out).nbytes} bytes, the chunk decodes to {values.nbytes}")
        return ndarray_copy(values, out)


def _zarr3_class():
    from zarr.codecs.numcodecs import _NumcodecsArrayBytesCodec

    class DeepCabacZarr3(_NumcodecsArrayBytesCodec, codec_name="deepcabac"):
        """zarr 3 array-to-bytes codec (``serializer=``) around :class:`DeepCabac`; same keywords."""

    DeepCabacZarr3.__module__ = __name__
    DeepCabacZarr3.__qualname__ = "DeepCabacZarr3"
    return DeepCabacZarr3


def __getattr__(name: str):
    # zarr is imported only by those who use it: numcodecs alone needs nothing of it.
    if name == "DeepCabacZarr3":
        cls = _zarr3_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
