"""Optimizer state in a checkpoint: which tensors are an optimizer's moments and steps.

A torch optimizer's ``state_dict()`` holds ``{"state": {index: {name: tensor}}, "param_groups": [...]}``;
flattened (:mod:`deepcabac_py.io.checkpoint`), its tensors are named ``...state.<index>.<name>``.
Their roles decide how they are coded (:mod:`.tensor_plan`):

* ``step``: the step count (a float tensor in recent torch): kept exact. A rounded step changes the
  bias correction of every later update.
* first moments (Adam's ``exp_avg``, SGD's ``momentum_buffer``) and second moments (``exp_avg_sq``,
  ``max_exp_avg_sq``): coded in the log domain (:mod:`deepcabac_py.quant.log_domain`), each element
  relative to its own magnitude. Adam's step is m / (sqrt(v) + eps): its elements are all of about
  the same size whatever the scale of m and v, so a uniform step (which rounds the many small
  moments to 0: a v of 1e-8 decoded as 0 makes the next step thousands of times too large) is the
  wrong measure here.

``param_groups`` and every other non-tensor entry are in the checkpoint's skeleton, kept exactly.
"""

from __future__ import annotations

import re

__all__ = ["FIRST_MOMENT", "SECOND_MOMENT", "STEP", "role_of"]

FIRST_MOMENT = "first moment"
SECOND_MOMENT = "second moment"
STEP = "step"

_ROLES = {"exp_avg": FIRST_MOMENT, "momentum_buffer": FIRST_MOMENT, "exp_avg_sq": SECOND_MOMENT,
          "max_exp_avg_sq": SECOND_MOMENT, "step": STEP}
_STATE_ENTRY = re.compile(r"(?:^|\.)state\.\d+\.(exp_avg|exp_avg_sq|max_exp_avg_sq|momentum_buffer|step)$")


def role_of(name: str) -> str | None:
    """The optimizer-state role of the tensor named ``name`` (``FIRST_MOMENT``, ``SECOND_MOMENT``,
    ``STEP``), or None for anything else."""
    m = _STATE_ENTRY.search(name)
    return _ROLES[m.group(1)] if m else None
