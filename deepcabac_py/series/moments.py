"""The optimizer's moments in a series: each first moment's second moment, the direction of the
step the two make (Adam's m / (sqrt(v) + eps), SGD's momentum buffer itself), and the update domain
a first moment is coded in (see :mod:`.checkpoint_series`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CorruptStreamError
from ..io.checkpoint import numpy_to_tensor, tensor_to_numpy
from ..model.optimizer_state import FIRST_MOMENT, first_moments, roles
from . import _series_kernels as _k
from . import arrays

# qp of a first moment in the update domain (``u`` has a root mean square of 1)
UPDATE_QP = -11
UPDATE_SUFFIX = "~update"  # the coded name of a first moment in the update domain (no role matches it)
ADAM_EPS = 1e-8  # (torch's default; where sqrt(v) is far above it, as it is wherever m matters, it is moot)
Moments = tuple[np.ndarray, "np.ndarray | None", tuple[int, ...]]  # (what direction_inputs gives)


def update_partners(tensors: dict[str, Any], skeleton: Any) -> dict[str, str | None]:
    """First moment -> the second moment its Adam step divides it by (``max_exp_avg_sq`` under
    amsgrad, else ``exp_avg_sq``), or None for SGD's momentum buffer (its step is lr times the
    buffer), for the first moments the update domain takes: float32/float64, one shape."""
    pairs: dict[str, str | None] = {}
    state = roles(tensors, skeleton)
    for name, t in tensors.items():
        if state.get(name) != FIRST_MOMENT:
            continue
        m, dm, _ = tensor_to_numpy(t)
        if dm not in ("float32", "float64") or not m.size:
            continue
        if is_momentum_buffer(name):
            pairs[name] = None
            continue
        partner = partner_of(name, tensors)
        if partner is None:
            continue
        v, dv, _ = tensor_to_numpy(tensors[partner])
        if dv in ("float32", "float64") and m.shape == v.shape:
            pairs[name] = partner
    return pairs


def is_momentum_buffer(first_moment: str) -> bool:
    """Whether a first moment (by its role: a name alone does not say) is SGD's momentum buffer."""
    return first_moment.endswith("momentum_buffer")


def partner_of(name: str, tensors: dict[str, Any]) -> str | None:
    """The second moment of Adam's first moment ``name`` among ``tensors`` (None for anything else)."""
    if not name.endswith("exp_avg"):
        return None
    stem = name[:-len("exp_avg")]
    return next((stem + p for p in ("max_exp_avg_sq", "exp_avg_sq") if stem + p in tensors), None)


def in_optimizer_order(firsts, skeleton: Any) -> list[str]:
    """First-moment names by optimizer, in the order the optimizers come (a GAN's checkpoint holds
    two: each numbers its own parameters from 0), then in their param groups' order of parameters
    (:func:`first_moments`: whatever the state's keys); those of no state dict in the skeleton
    (``<optimizer>.state.<i>.exp_avg`` by name alone) after them, by optimizer, then index."""
    firsts = list(firsts)
    known = {n: k for k, n in enumerate(first_moments(skeleton))}
    optimizers: dict[str, int] = {}
    rest = [n for n in firsts if n not in known]
    for n in rest:
        optimizers.setdefault(n.rsplit(".", 2)[0], len(optimizers))
    return (sorted((n for n in firsts if n in known), key=known.__getitem__)
            + sorted(rest, key=lambda n: (optimizers[n.rsplit(".", 2)[0]], int(n.split(".")[-2]))))


def direction_inputs(tensors: dict[str, Any], moment: str) -> Moments:
    """An entry's decoded first moment ``moment`` and the second moment its step divides it by, as
    the kernels read them (:func:`.arrays.flat`; None for SGD's momentum buffer, its own direction), and
    its shape; checked."""
    m, dm, _ = tensor_to_numpy(tensors[moment])
    if is_momentum_buffer(moment):
        return arrays.flat(m, dm), None, m.shape
    partner = partner_of(moment, tensors)
    if partner is None:
        raise CorruptStreamError(f"first moment {moment!r} has no second moment")
    v, dv, _ = tensor_to_numpy(tensors[partner])
    if m.shape != v.shape:
        raise CorruptStreamError(f"first moment {moment!r} does not match its second moment")
    return arrays.flat(m, dm), arrays.flat(v, dv), m.shape


def direction(tensors: dict[str, Any], moment: str) -> np.ndarray:
    """The direction of the optimizer's step of an entry's decoded first moment ``moment``
    (float64): m / (sqrt(v) + eps) for Adam's, SGD's momentum buffer itself."""
    return direction_of(*direction_inputs(tensors, moment))


def direction_of(m: np.ndarray, v: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """:func:`direction` of what :func:`direction_inputs` gives."""
    if v is None:
        return m.astype(np.float64).reshape(shape)
    out = np.empty(m.size, dtype=np.float64)
    _k.direction_into(m, v, ADAM_EPS, out)
    return out.reshape(shape)


def from_update_domain(where: str, tensors: dict[str, Any], scales: Any,
                       restored: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The decoded tensors with every first moment coded in the update domain back as itself, in
    its place (those of ``restored`` as they are there)."""
    restored = restored or {}
    if not isinstance(scales, dict) or not all(
            isinstance(n, str) and type(r) is float and np.isfinite(r) and r > 0 for n, r in scales.items()):
        raise CorruptStreamError(f"{where}: malformed update-domain scales")
    if not scales:
        return tensors
    out: dict[str, Any] = {}
    for coded_name, t in tensors.items():
        name = coded_name[:-len(UPDATE_SUFFIX)] if coded_name.endswith(UPDATE_SUFFIX) else None
        if name is None:
            out[coded_name] = t
            continue
        partner = partner_of(name, tensors)
        if name not in scales or (partner is None and not is_momentum_buffer(name)):
            raise CorruptStreamError(f"{where}: first moment {name!r} has no second moment or scale")
        if name in restored:
            out[name] = restored[name]
            continue
        u, dtype, is_torch = tensor_to_numpy(t)
        m = arrays.output(u.size, dtype)
        if partner is None:  # (SGD's momentum buffer: its own update domain)
            _k.times_into(arrays.flat(u, dtype), scales[name], m)
        else:
            v, dv, _ = tensor_to_numpy(tensors[partner])
            if u.shape != v.shape:
                raise CorruptStreamError(f"{where}: first moment {name!r} does not match its second moment")
            _k.from_update_into(arrays.flat(u, dtype), scales[name], arrays.flat(v, dv), ADAM_EPS, m)
        out[name] = numpy_to_tensor(arrays.carrier(m, dtype).reshape(u.shape), dtype, is_torch)
    if len(out) != len(tensors) or not set(scales) <= set(out):
        raise CorruptStreamError(f"{where}: update-domain scales name tensors the entry does not hold")
    return out
