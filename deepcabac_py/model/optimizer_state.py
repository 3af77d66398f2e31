"""Optimizer state in a checkpoint: which tensors are an optimizer's moments and steps.

A torch optimizer's ``state_dict()`` holds ``{"state": {index: {name: tensor}}, "param_groups": [...]}``;
flattened (:mod:`deepcabac_py.io.checkpoint`), its tensors are named ``...state.<index>.<name>``.
Their roles decide how they are coded (:mod:`.tensor_plan`), for every optimizer of ``torch.optim``:

* ``EXACT``: what no rounding may touch: step counts (a rounded step changes the bias correction of
  every later update), NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``, Rprop's ``step_size``
  (the step itself, of a few values: 6.5% off in norm at a quarter octave), Adafactor's factored
  ``row_var`` and ``col_var`` (a row and a column per matrix: exact costs nothing), L-BFGS's
  history, and centered RMSprop's ``grad_avg`` with its ``square_avg`` (the step divides by the
  square root of their difference, which rounding either can turn negative).
* first moments (Adam's ``exp_avg``, SGD's and RMSprop's ``momentum_buffer``, Rprop's ``prev``, of
  which only the sign counts) and second moments (Adam's ``exp_avg_sq`` and ``max_exp_avg_sq``,
  RMSprop's and Adadelta's ``square_avg``, Adadelta's ``acc_delta``, Adagrad's ``sum``, Adamax's
  ``exp_inf``, Adafactor's ``variance`` of a vector): coded in the log
  domain (:mod:`deepcabac_py.quant.log_domain`), each element relative to its own magnitude.
  Adam's step is m / (sqrt(v) + eps): its elements are all of about the same size whatever the
  scale of m and v, so a uniform step (which rounds the many small moments to 0: a v of 1e-8
  decoded as 0 makes the next step thousands of times too large) is the wrong measure here.

``param_groups`` and every other non-tensor entry are in the checkpoint's skeleton, kept exactly.
Any other tensor of an optimizer's state (ASGD's averaged weights ``ax``, another library's state)
is kept exact too (:func:`roles`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..io.checkpoint import skeleton_entries

__all__ = ["AdamGroup", "EXACT", "FIRST_MOMENT", "MomentumGroup", "SECOND_MOMENT", "adam_groups", "first_moments",
           "momentum_groups", "role_of", "roles"]

FIRST_MOMENT = "first moment"
SECOND_MOMENT = "second moment"
EXACT = "exact"

_ROLES = {
    **dict.fromkeys(("exp_avg", "momentum_buffer", "prev"), FIRST_MOMENT),
    **dict.fromkeys(("exp_avg_sq", "max_exp_avg_sq", "square_avg", "acc_delta", "sum", "exp_inf", "variance"),
                    SECOND_MOMENT),
    **dict.fromkeys(("step", "mu_product", "eta", "mu", "grad_avg", "row_var", "col_var", "step_size", "d", "t",
                     "H_diag", "prev_flat_grad", "prev_loss", "old_dirs", "old_stps", "ro", "al"), EXACT),
}
# (L-BFGS keeps lists of tensors: ``...state.0.old_dirs.<k>``)
_STATE_ENTRY = re.compile(r"(?:^|\.)state\.\d+\.(" + "|".join(sorted(_ROLES, key=len, reverse=True))
                          + r")(?:\.\d+)?$")


def role_of(name: str) -> str | None:
    """The optimizer-state role the tensor named ``name`` has by its name (``FIRST_MOMENT``,
    ``SECOND_MOMENT``, ``EXACT``), or None for anything else. :func:`roles` also reads the others'
    names: use it to code a checkpoint."""
    m = _STATE_ENTRY.search(name)
    return _ROLES[m.group(1)] if m else None


def roles(names: Iterable[str], skeleton: Any = None) -> dict[str, str]:
    """Name -> role of every optimizer-state tensor among ``names``: for the tensors that a torch
    optimizer state dict in the checkpoint's ``skeleton`` holds for a parameter, by their key
    there (whatever the parameter's key: an index, or its name in torch.distributed.checkpoint's
    state dicts), ``EXACT`` for a key no ``torch.optim`` optimizer writes (another library's
    state: bitsandbytes' block scales, say; what is not understood is not rounded); for the others
    as :func:`role_of` gives it; and a ``square_avg`` beside a ``grad_avg`` (centered RMSprop) is
    ``EXACT``."""
    out = {}
    for name in names:
        role = role_of(name)
        if role is not None:
            out[name] = role
    for _, entries in _parameter_states(skeleton):
        for key, node in entries.items():
            for name in _tensor_names([node]):
                out[name] = _ROLES.get(key, EXACT)
    for name in list(out):
        if name.endswith(".grad_avg"):
            sibling = name[:-len("grad_avg")] + "square_avg"
            if sibling in out:
                out[sibling] = EXACT
    return out


@dataclass(frozen=True)
class AdamGroup:
    """What an Adam (or AdamW) param group sets for one parameter, and the name of its step tensor."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    step: str | None


def adam_groups(skeleton: Any) -> dict[str, AdamGroup]:
    """First moment (``exp_avg``) tensor name -> its param group, for every torch optimizer state
    dict in a checkpoint's skeleton (:mod:`deepcabac_py.io.checkpoint`) whose groups are Adam's or
    AdamW's (told by their ``amsgrad``: RAdam's steps, for one, are smaller) and carry a positive
    ``lr``, ``betas`` in [0, 1) and an ``eps`` >= 0 as plain numbers. Anything else (another
    optimizer, an lr held as a tensor, a malformed skeleton) is left out, never an error."""
    out: dict[str, AdamGroup] = {}
    for group, moments in _parameter_states(skeleton):
        hyper, first = _adam_hyper(group), _tensor_name(moments.get("exp_avg"))
        if hyper is not None and first is not None and "amsgrad" in group:
            out[first] = AdamGroup(*hyper, _tensor_name(moments.get("step")))
    return out


@dataclass(frozen=True)
class MomentumGroup:
    """What an SGD or RMSprop param group with momentum sets for one parameter: its step is ``lr``
    times its momentum buffer (with Nesterov's momentum, about that)."""

    lr: float


def first_moments(skeleton: Any) -> list[str]:
    """The first moments (Adam's ``exp_avg``, SGD's ``momentum_buffer``) of every torch optimizer
    state dict in a checkpoint's skeleton, in the order of :func:`_parameter_states`: the order
    torch numbers a model's parameters in, whatever the state's keys (indices, or names in
    torch.distributed.checkpoint's state dicts)."""
    out: dict[str, None] = {}  # (in order, once each)
    for _, moments in _parameter_states(skeleton):
        name = _tensor_name(moments.get("exp_avg")) or _tensor_name(moments.get("momentum_buffer"))
        if name is not None:
            out[name] = None
    return list(out)


def momentum_groups(skeleton: Any) -> dict[str, MomentumGroup]:
    """Momentum buffer (``momentum_buffer``) tensor name -> its param group, as :func:`adam_groups`
    finds them, for SGD's and RMSprop's groups (told by their ``dampening`` and ``alpha``: Muon's
    buffer, for one, is not its step) with a positive ``lr`` and a ``momentum`` in (0, 1) as plain
    numbers."""
    out: dict[str, MomentumGroup] = {}
    for group, moments in _parameter_states(skeleton):
        lr, momentum = _number(group.get("lr")), _number(group.get("momentum"))
        buffer = _tensor_name(moments.get("momentum_buffer"))
        if (buffer is not None and ("dampening" in group or "alpha" in group) and lr is not None
                and momentum is not None and lr > 0 and 0 < momentum < 1):
            out[buffer] = MomentumGroup(lr)
    return out


def _number(x: Any) -> float | None:
    """A plain finite number of a skeleton as a float, else None."""
    return float(x) if type(x) in (int, float) and math.isfinite(x) else None


def _parameter_states(skeleton: Any) -> Iterator[tuple[dict, dict]]:
    """(param group, the state entries of one of its parameters) for every parameter of every torch
    optimizer state dict in a checkpoint's skeleton, nested anywhere (Lightning nests them), in
    order: the state dicts as the structure holds them, then their groups' ``params``."""
    stack = [skeleton.get("root") if isinstance(skeleton, dict) else None]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed(node))
            continue
        if not isinstance(node, dict) or "$tensor" in node:
            continue
        entries = skeleton_entries(node)
        if entries is None:
            stack.extend(reversed(list(node.values())))
            continue
        stack.extend(reversed(list(entries.values())))
        state, groups = skeleton_entries(entries.get("state")), entries.get("param_groups")
        if state is None or not isinstance(groups, list):
            continue
        for group in groups:
            g = skeleton_entries(group) or {}
            params = g.get("params")
            for index in params if isinstance(params, list) else []:
                yield g, (skeleton_entries(state.get(index)) if type(index) in (int, str) else None) or {}


def _tensor_names(nodes: list) -> Iterator[str]:
    """The names of the tensors in skeleton nodes and the lists and dicts within them."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        name = _tensor_name(node)
        if name is not None:
            yield name
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())


def _tensor_name(node: Any) -> str | None:
    name = node.get("$tensor") if isinstance(node, dict) else None
    return name if isinstance(name, str) else None


def _adam_hyper(group: dict) -> tuple[float, float, float, float] | None:
    betas = group.get("betas")
    if isinstance(betas, dict) and set(betas) == {"$tuple"}:
        betas = betas["$tuple"]
    pair = betas if isinstance(betas, list) and len(betas) == 2 else [None, None]
    lr, beta1, beta2, eps = (_number(x) for x in (group.get("lr"), *pair, group.get("eps")))
    if lr is None or beta1 is None or beta2 is None or eps is None:
        return None
    if lr <= 0 or not (0 <= beta1 < 1 and 0 <= beta2 < 1) or eps < 0:
        return None
    return lr, beta1, beta2, eps
