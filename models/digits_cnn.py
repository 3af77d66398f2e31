"""Tiny reference CNN for scikit-learn's 8x8 digits, and helpers to evaluate it.

This module must stay importable without scikit-learn: tests and the README demo
use it with only torch and numpy installed. Training lives in train_digits_cnn.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

MODELS_DIR = Path(__file__).resolve().parent
EVAL_SET_PATH = MODELS_DIR / "digits_eval.npz"
SAFETENSORS_PATH = MODELS_DIR / "digits_cnn.safetensors"
CHECKPOINT_PATH = MODELS_DIR / "digits_cnn.pt"

# load_digits pixels are integer counts 0..16 (4x4 blocks of a 32x32 bitmap).
PIXEL_MAX = 16.0
NUM_CLASSES = 10


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    # No conv bias: BatchNorm's own bias makes it redundant.
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class DigitsCNN(nn.Module):
    """Three 3x3 conv/BN/ReLU blocks on 1x8x8 input, then a linear head (~15k params).

    Input: float32 [N, 1, 8, 8] scaled to [0, 1] (pixel / 16). Output: [N, 10] logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn_relu(1, 16),
            _conv_bn_relu(16, 32),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            _conv_bn_relu(32, 32),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        self.classifier = nn.Linear(32 * 2 * 2, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def load_eval_set(path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out images as float32 [N, 1, 8, 8] in [0, 1] and labels as int64 [N]."""
    with np.load(EVAL_SET_PATH if path is None else path, allow_pickle=False) as data:
        images = data["images"]
        labels = data["labels"]
    x = torch.from_numpy(images.astype(np.float32) / PIXEL_MAX).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def build_model(state_dict: dict[str, torch.Tensor]) -> DigitsCNN:
    """A DigitsCNN in eval mode with state_dict loaded strictly (shape or key drift raises)."""
    model = DigitsCNN()
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


@torch.no_grad()
def logits(state_dict: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return build_model(state_dict)(x)


@torch.no_grad()
def accuracy(state_dict: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    pred = logits(state_dict, x).argmax(dim=1)
    # Counted in Python ints so 359/360 comes out exact, not float32-rounded.
    return (pred == y).sum().item() / len(y)
