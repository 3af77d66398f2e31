"""The settings of a whole-model encode, validated once and passed down as one object.

:func:`~deepcabac_py.model.encoder.encode_model` and
:func:`~deepcabac_py.model.encoder.quantize_model` take these as keyword arguments and build one
:class:`EncodeSettings` from them; everything below them reads it. No torch here: the CLI reads the
defaults without paying for it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ..quant.quantizers import DEFAULT_LAMBDA, check_quantizer
from ..quant.steps import check_qp, qp_range, step_from_qp
from . import batchnorm

DEFAULT_QP = -32
DEFAULT_QP_DENSITY = 2
DEFAULT_QUANTIZER = "trellis"
# importance="structural" (the default): data-free importance from the model's own structure
# (embedding tables, BatchNorm statistics), see deepcabac_py/model/structural_importance.py.
STRUCTURAL = "structural"
DEFAULT_IMPORTANCE = STRUCTURAL
# Tensors with at most one dimension (biases, norms) are few but sensitive: by default their step is
# QP_1D_OCTAVES octaves finer than the weights' (as close to lossless in effect as NNC's fixed qp -75,
# for fewer bytes: docs/design-notes.md). qp_1d=-75 gives NNC's setting.
QP_1D_OCTAVES = 6
# Optimizer moments (model.optimizer_state) in the log domain: qp -8 at density 2 is a step of a
# quarter octave, a relative error of at most 9% per element (4.4% for sqrt(v)); the next Adam
# step keeps a cosine above 0.99 with the original's (tests/test_optimizer_state.py measures it).
DEFAULT_MOMENTS_QP = -8


@dataclass(frozen=True)
class EncodeSettings:
    """How a model is quantized and coded; the keyword arguments of ``encode_model``.

    Parameters
    ----------
    qp : int
        Quantization parameter of tensors with two or more dimensions: the step is
        :func:`~deepcabac_py.quant.steps.step_from_qp` of it. Lower is finer (more bytes, less
        error); ``2**qp_density`` steps of qp make an octave.
    qp_density : int
        Steps of qp per octave are ``2**qp_density`` (0 to 6).
    qp_1d : int or None
        qp of tensors with at most one dimension (biases, norms); None: ``QP_1D_OCTAVES`` octaves
        finer than ``qp``.
    qp_overrides : mapping of str to int
        Tensor names or glob patterns to their own qp; they win over every other choice.
    keep_exact : bool, str or iterable of str
        True, or names/patterns of float tensors to store bit-exactly.
    quantizer : {"trellis", "rdoq", "nearest"}
        Dependent quantization (fewest bytes at a given fidelity; effective step about twice the
        step of qp), rate-distortion optimised rounding, or plain rounding.
    lambda_scale : float
        Scales the rate-distortion trade-off of the trellis and RDOQ (larger: fewer bytes).
    importance : mapping, "structural" or None
        Per-weight importance (tensor name to an array of its shape, or one number per tensor):
        errors cost more where it is high, and each tensor's step follows its mean importance.
        ``"structural"`` derives it from the model without data; None weighs every weight alike.
    batchnorm_eps : float, mapping of str to float, or None
        The eps of the model's BatchNorm layers (one number, or module names to numbers): their
        running statistics are then coded coarsely and their weight and bias compensate exactly.
    bias_correction : bool
        Take the mean output shift of each layer's quantization error out of the BatchNorm after
        it (or its own bias), estimated without data.
    moments_qp : int
        qp of an optimizer's moments (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's momentum, and the
        others of :mod:`.optimizer_state`), coded in the log domain: the step of this qp, in
        octaves, is the precision of log2 of each magnitude. Optimizer steps and what no rounding
        may touch are kept exact.
    """

    qp: int = DEFAULT_QP
    qp_density: int = DEFAULT_QP_DENSITY
    qp_1d: int | None = None
    qp_overrides: Mapping[str, int] | None = field(default_factory=dict)
    keep_exact: bool | str | Iterable[str] = False
    quantizer: str = DEFAULT_QUANTIZER
    lambda_scale: float = 1.0
    importance: Mapping[str, Any] | str | None = DEFAULT_IMPORTANCE
    batchnorm_eps: float | Mapping[str, float] | None = None
    bias_correction: bool = True
    moments_qp: int = DEFAULT_MOMENTS_QP

    def __post_init__(self) -> None:
        if not isinstance(self.bias_correction, bool):
            raise TypeError(f"bias_correction must be True or False, got {self.bias_correction!r}")
        check_quantizer(self.quantizer)
        scale = self.lambda_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 <= float(scale) < math.inf:
            raise ValueError(f"lambda_scale must be a finite number >= 0, got {scale!r}")
        object.__setattr__(self, "lambda_scale", float(scale))
        importance = self.importance
        if isinstance(importance, str):
            if importance != STRUCTURAL:
                raise ValueError(f"importance must be a mapping, {STRUCTURAL!r} or None, got {importance!r}")
        elif importance is not None:
            if not isinstance(importance, Mapping):
                raise TypeError("importance must map tensor names to arrays of their shape (or numbers)")
            object.__setattr__(self, "importance", dict(importance))
        object.__setattr__(self, "batchnorm_eps", batchnorm.check_eps(self.batchnorm_eps))
        qp, density = check_qp(self.qp, self.qp_density)
        object.__setattr__(self, "qp", qp)
        object.__setattr__(self, "qp_density", density)
        for value in (self.qp, self.qp_1d_resolved, self.moments_qp):
            step_from_qp(value, density)  # a step inside float64
        overrides = dict(self.qp_overrides or {})
        for value in overrides.values():
            step_from_qp(value, density)
        object.__setattr__(self, "qp_overrides", overrides)
        exact = self.keep_exact
        if not exact:
            exact = False
        elif exact is not True:
            exact = (exact,) if isinstance(exact, str) else tuple(exact)
        object.__setattr__(self, "keep_exact", exact)

    @property
    def qp_1d_resolved(self) -> int:
        """The qp of tensors with at most one dimension."""
        if self.qp_1d is not None:
            return self.qp_1d
        return max(qp_range(self.qp_density)[0], self.qp - (QP_1D_OCTAVES << self.qp_density))

    @property
    def lam(self) -> float:
        """The quantizer's lambda (step**2 per bit)."""
        return DEFAULT_LAMBDA[self.quantizer] * self.lambda_scale

    @property
    def dependent(self) -> bool:
        """Quantized tensors are coded as dependent quantization (the trellis)."""
        return self.quantizer == "trellis"

    @property
    def structural(self) -> bool:
        return self.importance == STRUCTURAL

    def check_patterns(self, names: Iterable[str]) -> None:
        """ValueError for a ``qp_overrides`` key or ``keep_exact`` pattern that names none of these
        tensors: a typo would otherwise leave the defaults in place without a word."""
        names = list(names)
        exact = () if isinstance(self.keep_exact, bool) else self.keep_exact
        for what, patterns in (("qp_overrides", list(self.qp_overrides or {})), ("keep_exact", list(exact))):
            for pattern in patterns:
                if pattern not in names and not any(fnmatchcase(n, pattern) for n in names):
                    raise ValueError(f"{what}: {pattern!r} matches no tensor of the model")

    def is_exact(self, name: str) -> bool:
        """Whether float tensor ``name`` is stored bit-exactly."""
        if isinstance(self.keep_exact, bool):
            return self.keep_exact
        return matches(name, self.keep_exact)


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches one of the glob ``patterns`` (case-sensitive)."""
    return any(name == p or (is_glob(p) and fnmatchcase(name, p)) for p in patterns)


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` has a wildcard: one without matches the name it spells and no other (a
    series names every tensor it overrides: hundreds of names, asked about by every tensor)."""
    return "*" in pattern or "?" in pattern or "[" in pattern


def lookup_qp(name: str, overrides: Mapping[str, int]) -> int | None:
    """The qp ``overrides`` give ``name``: its own entry, else the first pattern that matches."""
    if name in overrides:
        return overrides[name]
    for pattern, value in overrides.items():
        if is_glob(pattern) and fnmatchcase(name, pattern):
            return value
    return None
