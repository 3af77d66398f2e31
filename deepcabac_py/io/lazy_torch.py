"""torch, imported only where a call needs it.

Importing torch takes one to two seconds, more than encoding a small model: a safetensors or npz round
trip, ``info`` and ``test`` never need it. A value can only be a torch object once torch has been
imported, so type checks look for torch in ``sys.modules`` instead of importing it; code that builds
torch objects (a ``.pt`` checkpoint, a decoded model for a torch caller) imports it then.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs

__all__ = ["torch_module", "loaded_torch", "is_torch_tensor"]


def torch_module() -> ModuleType:
    """torch, imported now if it was not yet."""
    import torch

    return torch


def loaded_torch() -> ModuleType | None:
    """torch if something imported it already, else None (then no object can be a torch one)."""
    return sys.modules.get("torch")


def is_torch_tensor(x: object) -> TypeIs[torch.Tensor]:
    """Whether ``x`` is a ``torch.Tensor``, without importing torch."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # (None too while torch is being imported)
    return tensor is not None and isinstance(x, tensor)
