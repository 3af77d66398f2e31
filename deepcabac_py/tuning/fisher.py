"""Per-weight importance from data: the diagonal of the Fisher information.

Passed as ``encode_model(..., importance=diagonal_fisher(...))`` it weights the squared error of
every weight in the RD quantizers and sets each tensor's step
(:func:`deepcabac_py.model.allocation.allocate_qps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


def diagonal_fisher(model, batches: Iterable[Any], loss_fn: Callable[[Any, Any], Any], *,
                    names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Mean squared gradient of ``loss_fn(model, batch)`` over ``batches``, per parameter.

    ``model`` is a ``torch.nn.Module``; the result maps its state-dict names (of the parameters
    that require gradients, or of ``names``) to float32 arrays of the parameter's shape. With a loss
    whose gradient samples the model's own output distribution (cross-entropy against labels drawn
    from its softmax; a random projection of an embedding) this is the diagonal of the Fisher
    information, which predicts how much a small change of each weight moves the outputs.
    """
    import torch

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if names is not None:
        wanted = list(names)
        missing = [n for n in wanted if n not in params]
        if missing:
            raise ValueError(f"not parameters of the model: {', '.join(missing[:5])}")
        params = {n: params[n] for n in wanted}
    if not params:
        raise ValueError("the model has no parameters that require gradients")
    order = list(params)
    sums = {n: torch.zeros_like(params[n], dtype=torch.float64) for n in order}
    count = 0
    for batch in batches:
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        grads = torch.autograd.grad(loss, [params[n] for n in order], allow_unused=True)
        for n, g in zip(order, grads):
            if g is not None:
                sums[n] += g.detach().to(torch.float64) ** 2
        count += 1
    if count == 0:
        raise ValueError("no calibration batches")
    return {n: (sums[n] / count).to(torch.float32).cpu().numpy() for n in order}
