"""A lossless series' residuals, taken on the float bits: the difference of order-preserving
integer keys (from the parent's, or from a prediction's), or the XOR with the parent's; and back."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptStreamError
from ..io.checkpoint import Checkpoint, numpy_to_tensor, tensor_to_numpy
from ..model.encoder import encode_model
from . import arrays, predictions

WORDS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "float64": np.uint64}
DELTAS = {"bfloat16": "int16", "float16": "int16", "float32": "int32", "float64": "int64"}


def order_key(words: np.ndarray) -> np.ndarray:
    """Float bits as unsigned integers in the order of the values (negatives reversed below the
    positives), so that close values have close keys."""
    top = np.array(1, dtype=words.dtype) << np.array(8 * words.itemsize - 1, dtype=words.dtype)
    return np.where(words & top, ~words, words | top)


def from_order_key(keys: np.ndarray) -> np.ndarray:
    """The float bits of order keys (:func:`order_key`)."""
    top = np.array(1, dtype=keys.dtype) << np.array(8 * keys.itemsize - 1, dtype=keys.dtype)
    return np.where(keys & top, keys ^ top, ~keys)


def residual_checkpoint(ckpt: Checkpoint, parent: Checkpoint,
                        pairs: dict[str, str]) -> tuple[Checkpoint, list[str], list[str], dict[str, list]]:
    """``ckpt`` with every float tensor replaced by what codes smallest of: itself, the difference
    of its order keys from ``parent``'s (a signed integer of the same width, wrapping; coded by
    magnitude class when wide), the XOR of its bits with ``parent``'s (as the same float dtype: the
    float coder drops what did not change, sign and exponent) and, for a weight with an Adam
    first moment, the difference of its keys from a prediction's (the parent plus the entry's and
    the parent's m / (sqrt(v) + eps), each times a coefficient fitted by least squares). Returns
    it, the names coded by key difference and by XOR, and the predictions: weight -> [first
    moment, c_entry, c_parent] (``pairs``: weight -> first moment, :func:`.steps.weight_pairs`)."""
    tensors: dict[str, Any] = {}
    keyed: list[str] = []
    xored: list[str] = []
    predicted: dict[str, list] = {}
    for name, t in ckpt.tensors.items():
        arr, dtype, is_torch = tensor_to_numpy(t)
        words = WORDS.get(dtype)
        if words is None or not arr.size:
            tensors[name] = t
            continue
        base, _, _ = tensor_to_numpy(parent.tensors[name])
        mine = np.require(arr, requirements="C").view(words)
        theirs = np.require(base, requirements="C").view(words)
        delta = np.asarray(order_key(mine) - order_key(theirs)).reshape(arr.shape).view(DELTAS[dtype])
        xor = np.asarray(mine ^ theirs).reshape(arr.shape).view(arr.dtype)
        options: list[tuple[Any, Any]] = [(t, None), (numpy_to_tensor(xor, dtype, is_torch), xored),
                                          (numpy_to_tensor(delta, DELTAS[dtype], is_torch), keyed)]
        if name in pairs:
            moment = pairs[name]
            change = arrays.floats(arr, dtype) - arrays.floats(base, dtype)
            fit = predictions.fitted_prediction(change, ckpt.tensors, parent.tensors, moment)
            if fit is not None:
                coefs, now, before = fit
                guess = np.require(predicted_bits(base, dtype, predictions.combined(coefs, now, before)),
                                   requirements="C").view(words)
                wrong = np.asarray(order_key(mine) - order_key(guess)).reshape(arr.shape).view(DELTAS[dtype])
                options.append((numpy_to_tensor(wrong, DELTAS[dtype], is_torch), (moment, *coefs)))
        sizes = [len(encode_model({name: option}, keep_exact=True, threads=1)) for option, _ in options]
        chosen, names = options[int(np.argmin(sizes))]
        tensors[name] = chosen
        if isinstance(names, tuple):  # (a prediction: its moment and coefficients)
            predicted[name] = list(names)
        elif names is not None:
            names.append(name)
    return arrays.with_tensors(ckpt, tensors), keyed, xored, predicted


def predicted_bits(base: np.ndarray, dtype: str, change: np.ndarray) -> np.ndarray:
    """The parent plus a predicted change, rounded once to ``dtype`` (its carrier)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return arrays.to_carrier(arrays.floats(base, dtype) + change, dtype)


def restored(where: str, tensors: dict[str, Any], parent: dict[str, Any], keyed: list[str], xored: list[str],
             predicted: dict[str, tuple[str, tuple[float, float]]]) -> None:
    """The bit residuals of an entry's decoded ``tensors`` back as themselves, in place: ``keyed``
    (key differences from ``parent``'s), ``xored`` (XORs) and ``predicted`` (key differences from a
    prediction's: :func:`.predictions.read_predicted`)."""
    for name in keyed + xored + list(predicted):  # (predicted last: from the moments as restored)
        if name not in parent:
            raise CorruptStreamError(f"{where}: residual {name!r} has no parent tensor")
        base, dtype, is_torch = tensor_to_numpy(parent[name])
        delta, delta_dtype, _ = tensor_to_numpy(tensors[name])
        words = WORDS.get(dtype)
        if (words is None or delta.shape != base.shape
                or delta_dtype != (dtype if name in xored else DELTAS.get(dtype))):
            raise CorruptStreamError(f"{where}: bit residual {name!r} does not match its parent")
        if name in predicted:
            moment, coefs = predicted[name]
            base = predicted_bits(base, dtype, predictions.prediction(tensors, parent, moment, coefs))
        theirs = np.require(base, requirements="C").view(words)
        if name in keyed or name in predicted:
            bits = from_order_key(np.asarray(order_key(theirs) + delta.view(words)))  # (modulo 2**width)
        else:
            bits = theirs ^ np.require(delta, requirements="C").view(words)
        tensors[name] = numpy_to_tensor(np.asarray(bits).view(base.dtype).reshape(base.shape), dtype, is_torch)
