"""The learning task both ends share: a 20-feature synthetic binary problem and a small MLP."""

from __future__ import annotations

import numpy as np
import torch

FEATURES = 20
HIDDEN = 64
CLASSES = 2
SHARD_SIZE = 256
TEST_SEED = 99  # the server's held-out set; clients use their partition id as the seed


def make_net() -> torch.nn.Module:
    """The model, with the same initial weights wherever it is built."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


def shard(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``SHARD_SIZE`` Gaussian points labelled by the sign of ``x0 + x1``, drawn from ``seed``."""
    x = np.random.default_rng(seed).normal(size=(SHARD_SIZE, FEATURES)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


def train_steps(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> None:
    """Full-batch SGD on cross-entropy."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


@torch.no_grad()
def accuracy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((net(x).argmax(1) == y).float().mean())
