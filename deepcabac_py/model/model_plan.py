"""How a whole model is coded: a plan per tensor, with the choices that look across tensors.

:func:`plan_model` resolves the settings against the model once: importance (given, or structural),
the bit allocation across tensors it implies, the BatchNorm treatment (statistics coded coarsely,
weight and bias compensating) and the data-free bias correction (which tensor takes out which
layer's mean output shift, once that layer's levels are known).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..io.checkpoint import Checkpoint, TensorLike, flatten, is_plain_structure, tensor_of_bits, tensor_to_numpy
from ..io.files import SafetensorsLayout, safetensors_code
from ..io.tensor_source import CheckpointSource, TensorSource
from ..quant.steps import QP_MIN, step_from_qp
from . import batchnorm, optimizer_state
from .allocation import allocate_qps
from .container import FLAG_ALIAS, FLAG_TORCH, Coder, TensorEntry, metadata_bytes
from .settings import EncodeSettings, lookup_qp
from .structural_importance import (
    BN_EPS,
    output_shift,
    rule_arrays,
    rule_vectors,
    shift_absorbers,
    structural_importance,
)
from .tensor_plan import TensorPlan, TensorPlanner, importance_array


@dataclass
class Shift:
    """A layer's expected output shift (from its quantization error), taken out by another tensor:
    ``target += factor * shift`` (:func:`~deepcabac_py.model.structural_importance.shift_absorbers`),
    where the layer turns out quantized."""

    layer: str
    mean_in: np.ndarray
    target: str
    factor: Any  # a number or one per channel


@dataclass
class ModelPlan:
    """How every tensor of a model is coded: the choices that look across tensors made once, the
    plans of the tensors those choices read made up front, every other tensor planned when it is
    coded (:meth:`plan`), so that a model read from disk is never held whole."""

    source: TensorSource
    planner: TensorPlanner  # plans a tensor with the model's resolved settings
    fixed: dict[str, TensorPlan]  # planned up front: the rules' vectors (BatchNorm weight and bias compensated)
    shifts: list[Shift]
    # the header's metadata (the checkpoint's kind and structure) as the header stores it, checked
    # against the format's limits together with the tensors' names and shapes
    metadata_json: bytes

    @property
    def names(self) -> list[str]:
        """The tensors in table order (aliases after them, see :meth:`alias_entries`)."""
        return self.source.names

    @property
    def shift_targets(self) -> set[str]:
        return {sh.target for sh in self.shifts}

    @property
    def shift_layers(self) -> set[str]:
        return {sh.layer for sh in self.shifts}

    def plan(self, name: str) -> TensorPlan:
        """Tensor ``name``'s plan (loaded from the source unless planned up front)."""
        fixed = self.fixed.get(name)
        return fixed if fixed is not None else self.planner.plan(name, self.source.load(name))

    def shift_deltas(self, layer: TensorPlan, decoded: np.ndarray) -> list[tuple[str, Any]]:
        """``(target, delta)`` for every shift of ``layer`` once coded with these ``decoded`` values
        (float64, the tensor's shape); nothing if the layer was not quantized."""
        if not layer.is_quantized:
            return []
        return [(sh.target, sh.factor * output_shift(layer.values, decoded, sh.mean_in))
                for sh in self.shifts if sh.layer == layer.name]

    def with_shifts(self, target: str, delta: Any) -> TensorPlan:
        """The plan of shift target ``target`` planned again from its values plus ``delta`` (the sum
        of its layers' shifts); as it was when that would not be finite."""
        plan = self.fixed[target]
        values = plan.values.astype(np.float64) + delta
        if not np.all(np.isfinite(values)):
            return plan
        e = plan.entry
        return self.planner.plan(target, tensor_of_bits(values.astype(plan.values.dtype), e.dtype.dtype_name,
                                                        bool(e.flags & FLAG_TORCH)))

    def alias_entries(self, entries: Mapping[str, TensorEntry]) -> list[TensorEntry]:
        """The aliases' table entries, after every tensor's (``entries``: the tensors' as coded)."""
        index = {name: i for i, name in enumerate(self.names)}
        out = []
        for alias, target in self.source.aliases.items():
            base = entries[target]
            out.append(TensorEntry(name=alias, dtype=base.dtype, shape=base.shape, mode=base.mode,
                                   coder=Coder.NONE, flags=FLAG_ALIAS | (base.flags & FLAG_TORCH),
                                   alias_of=index[target]))
        return out


def plan_model(model: Mapping[str, Any] | Checkpoint | TensorSource, settings: EncodeSettings) -> ModelPlan:
    """Plan a model: a mapping of tensors, a :class:`Checkpoint` or a :class:`TensorSource`."""
    if isinstance(model, TensorSource):
        source = model
    else:
        source = CheckpointSource(model if isinstance(model, Checkpoint) else flatten(model))
    settings.check_patterns(source.names)
    metadata = stream_metadata(source)
    # Before any work: what the stream cannot hold (too many tensors, names too long, shapes numpy
    # cannot hold, a structure too large) is refused now, not after coding every tensor.
    metadata_json = metadata_bytes(metadata, [(n, source.spec(n).shape) for n in source.names]
                                   + [(alias, source.spec(target).shape) for alias, target in source.aliases.items()])
    if settings.keep_exact is True and not isinstance(settings.importance, Mapping):
        # nothing is quantized: no rule, importance or allocation has anything to decide
        return ModelPlan(source, TensorPlanner(settings, {}, {}), {}, [], metadata_json)
    given = rule_vectors(source)  # (read once: every rule below works on them)
    arrays = rule_arrays(source, given)
    # (the absorbers are found from the statistics as given, before any compensation)
    absorbers = shift_absorbers(source, arrays=arrays) if settings.bias_correction else {}
    bn = _BatchNorms.find(given, settings)
    planner = _planner(source, given, arrays, settings, bn.overrides(settings))
    fixed = {name: planner.plan(name, t) for name, t in given.items()}
    fixed, eps_modules = bn.compensate(fixed, planner)
    return ModelPlan(source, planner, fixed, _shifts(given, fixed, absorbers, eps_modules), metadata_json)


def stream_metadata(source: TensorSource) -> dict:
    """The header's metadata of a model: its kind and, unless it is a plain flat state dict (which
    the decoder rebuilds from the tensor table), its structure; a safetensors file's own metadata."""
    metadata: dict[str, Any] = {"kind": source.kind}
    if not is_plain_structure(source.skeleton, source.names, source.aliases, allow_ordered=False):
        metadata["skeleton"] = source.skeleton
    if source.metadata is not None:
        metadata["safetensors_metadata"] = source.metadata
    header = _unusual_safetensors_header(source)
    if header is not None:
        metadata["safetensors_header"] = header
    return metadata


# A header longer than this is not kept (the stream's metadata holds 8 MiB): such a file decodes to
# the same tensors in this library's own layout.
MAX_KEPT_HEADER = 1 << 22


def _unusual_safetensors_header(source: TensorSource) -> str | None:
    """A safetensors file's header where this library would write another (other key order, spacing,
    padding or data order), so that decoding can restore the file byte for byte; else None."""
    text = source.file_header
    if text is None or len(text) > MAX_KEPT_HEADER:
        return None
    specs = [(n, safetensors_code(source.spec(n).dtype_name), list(source.spec(n).shape)) for n in source.names]
    ours = SafetensorsLayout.of(specs, None, source.metadata, None, True).header[8:]
    return None if ours == text.encode("utf-8") else text


def _planner(source: TensorSource, vectors: Mapping[str, TensorLike], arrays: Mapping[str, np.ndarray],
             settings: EncodeSettings, overrides_in: Mapping[str, int]) -> TensorPlanner:
    """The planner of a model's tensors: importance resolved, the qps it allocates, variance floors."""
    reference = None
    importance: dict[str, Any]
    if isinstance(settings.importance, Mapping):
        importance = dict(settings.importance)
    elif settings.structural:
        importance = dict(structural_importance(source, arrays=arrays))
        reference = 0.0  # importance 1 (a dense layer without BN) is the reference that gets qp itself
    else:
        importance = {}
    unknown = sorted(set(importance) - set(source.names))
    if unknown:
        raise ValueError(f"importance names tensors the model does not have: {', '.join(unknown[:5])}")
    overrides = dict(overrides_in)
    if importance:
        # Importance also allocates the bits across tensors; explicit overrides still win.
        shapes = {name: source.spec(name).shape for name in source.names}
        allocated = allocate_qps({n: importance_array(v) for n, v in importance.items()}, shapes, settings.qp,
                                 qp_density=settings.qp_density, qp_1d=settings.qp_1d_resolved, reference=reference)
        overrides = {**{n: q for n, q in allocated.items() if lookup_qp(n, overrides) is None}, **overrides}
    _floor_variance_steps(vectors, overrides, overrides_in, settings)
    return TensorPlanner(settings, overrides, importance, optimizer_state.roles(source.names, source.skeleton))


def _floor_variance_steps(vectors: Mapping[str, TensorLike], overrides: dict[str, int], fixed: Mapping[str, int],
                          settings: EncodeSettings) -> None:
    """Keep every BatchNorm running variance above the eps it is added to from decoding to 0 (the
    channel's scale would jump by sqrt(var / eps)): the step of a ``*.running_var`` tensor stays at
    most a quarter of its smallest such variance, unless its qp is ``fixed`` (by the user or the
    BatchNorm treatment). Allocation can give these tensors coarse steps."""
    for name, t in vectors.items():
        if not name.endswith(".running_var") or lookup_qp(name, fixed) is not None:
            continue
        arr, dtype_name, _ = tensor_to_numpy(t)
        if arr.ndim != 1 or dtype_name not in ("float32", "float64"):
            continue
        above = arr[np.isfinite(arr) & (arr > BN_EPS)]
        if not above.size:
            continue
        bound = float(above.min()) / 4.0
        chosen = lookup_qp(name, overrides)
        chosen = settings.qp_1d_resolved if chosen is None else chosen
        while chosen > QP_MIN and step_from_qp(chosen, settings.qp_density) > bound:
            chosen -= 1
        overrides[name] = chosen


@dataclass
class _BatchNorms:
    """The BatchNorm layers that ``batchnorm_eps`` applies to, with their float tensors."""

    eps: float | Mapping[str, float] | None
    modules: list[str]
    arrays: dict[str, np.ndarray]  # the 1-D float tensors a BatchNorm layer may own
    kinds: dict[str, tuple[str, bool]]  # their (dtype, is_torch)

    @classmethod
    def find(cls, vectors: Mapping[str, TensorLike], settings: EncodeSettings) -> _BatchNorms:
        eps = settings.batchnorm_eps
        if eps is None:
            return cls(None, [], {}, {})
        arrays, kinds = {}, {}
        for name, t in vectors.items():
            if name.rsplit(".", 1)[-1] in batchnorm.TENSORS:
                a, dtype, is_torch = tensor_to_numpy(t)
                if dtype in ("float32", "float64") and a.ndim == 1:
                    arrays[name], kinds[name] = a, (dtype, is_torch)
        found = batchnorm.groups(arrays)
        if isinstance(eps, Mapping):
            unknown = sorted(set(eps) - set(found))
            if unknown:
                raise ValueError(f"batchnorm_eps names no BatchNorm layer of the model: {', '.join(unknown[:5])}")
        modules = [m for m in found if batchnorm.eps_of(m, eps) is not None]
        return cls(eps, modules, arrays, kinds)

    def eps_of(self, module: str) -> float:
        eps = batchnorm.eps_of(module, self.eps) if self.eps is not None else None
        if eps is None:
            raise RuntimeError(f"internal error: batchnorm_eps does not apply to {module!r}")
        return eps

    def overrides(self, settings: EncodeSettings) -> dict[str, int]:
        """The user's qp overrides, and the coarse qps of the statistics the user did not set."""
        user = settings.qp_overrides or {}
        out = dict(user)
        for m in self.modules:
            qps = batchnorm.statistics_qps(self.arrays[f"{m}.running_mean"], self.arrays[f"{m}.running_var"],
                                           self.eps_of(m), settings.qp, settings.qp_density)
            for stat, stat_qp in zip(batchnorm.STATISTICS, qps):
                if lookup_qp(f"{m}.{stat}", user) is None:
                    out[f"{m}.{stat}"] = stat_qp
        return out

    def compensate(self, plans: dict[str, TensorPlan], planner: TensorPlanner
                   ) -> tuple[dict[str, TensorPlan], dict[str, float]]:
        """The vectors' plans with each layer's weight and bias made up for its statistics exactly
        as the stream will carry them, and the eps of every layer this applied to."""
        coded = {}
        for m in self.modules:
            stats = [plans[name] for name in (f"{m}.{stat}" for stat in batchnorm.STATISTICS) if name in plans]
            # (weight and bias may be kept exact: then the layer's function is kept to float rounding)
            if len(stats) == len(batchnorm.STATISTICS) and all(p.is_quantized for p in stats):
                coded[m] = [np.asarray(p.quantized().dequantize(), dtype=np.float64) for p in stats]
        if not coded:
            return plans, {}
        # Weight and bias are planned with the settings every other tensor got (so nothing else
        # changes, not even the steps that importance allocated).
        plans = dict(plans)
        for m, (mean_c, var_c) in coded.items():
            a = self.arrays
            new = batchnorm.compensate(a[f"{m}.weight"], a[f"{m}.bias"], a[f"{m}.running_mean"],
                                       a[f"{m}.running_var"], mean_c, var_c, self.eps_of(m))
            if new is None:
                raise CheckpointError(f"BatchNorm {m}: running_var must be finite and > -eps to code its statistics"
                                      " coarsely (leave the layer out of batchnorm_eps)")
            for suffix, value in zip(("weight", "bias"), new):
                name = f"{m}.{suffix}"
                dtype, is_torch = self.kinds[name]
                plans[name] = planner.plan(name, tensor_of_bits(value.astype(dtype), dtype, is_torch))
        return plans, {m: self.eps_of(m) for m in coded}


def _shifts(vectors: Mapping[str, TensorLike], plans: Mapping[str, TensorPlan],
            absorbers: Mapping[str, tuple[np.ndarray, str]], eps_modules: Mapping[str, float]) -> list[Shift]:
    """The shifts to take out, where the absorbing tensor is quantized (a tensor kept exact stays
    exact) and float32 or float64 (``vectors``: BatchNorm weights as compensated, statistics as
    given). Whether the layer is quantized is known once it is planned (:meth:`ModelPlan.shift_deltas`)."""
    out = []
    for layer, (mean_in, target) in absorbers.items():
        factor: Any = -1.0 if target.endswith(".bias") else 1.0
        module = target.rsplit(".", 1)[0]
        if target.endswith(".running_mean") and module in eps_modules:
            # the statistics are coded coarsely and weight and bias compensate: the bias takes it,
            # scaled as the BN scales its input (its weight as given: the compensated one differs)
            arrays = {s: tensor_to_numpy(vectors[f"{module}.{s}"])[0].astype(np.float64)
                      for s in ("weight", "running_var")}
            factor = -arrays["weight"] / np.sqrt(np.maximum(arrays["running_var"], 0.0) + eps_modules[module])
            target = f"{module}.bias"
        p = plans.get(target)
        if p is not None and p.is_quantized and p.values.dtype in (np.float32, np.float64):
            out.append(Shift(layer, mean_in, target, factor))
    return out
