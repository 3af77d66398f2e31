"""Inference on compressed weights: torch modules whose products run on CER/CSER matrices.

:class:`CompressedLinear` and :class:`CompressedConv2d` hold a :mod:`~deepcabac_py.matrix.formats`
matrix instead of a dense weight and call its Numba kernels on float32 numpy views of the input (CPU
only, no autograd: inference). Convolutions go through im2col (``torch.nn.functional.unfold``);
1x1 convolutions with stride 1 and no padding skip it. :func:`compress_module` decodes a model
stream and swaps every matching ``nn.Linear`` / ``nn.Conv2d`` of a model for its compressed twin::

    model.load_state_dict(decode_model(data))   # or let compress_module load the stream's tensors
    compress_module(model, data, formats="cser")
    logits = model(images)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .formats import CERMatrix, CSERMatrix, from_stream

__all__ = ["CompressedConv2d", "CompressedLinear", "compress_module"]

_MATRIX_TYPES = (CERMatrix, CSERMatrix)


def _check_matrix(matrix) -> None:
    if not isinstance(matrix, _MATRIX_TYPES):
        raise TypeError(f"matrix must be a CERMatrix or CSERMatrix, got {type(matrix).__name__}")


def _bias_tensor(bias, out_features: int):
    if bias is None:
        return None
    b = torch.as_tensor(bias).detach().to(torch.float32).reshape(-1).clone()
    if b.numel() != out_features:
        raise ValueError(f"bias has {b.numel()} elements, expected {out_features}")
    return b


def _as_f32_numpy(x: torch.Tensor) -> np.ndarray:
    if x.device.type != "cpu":
        raise ValueError(f"compressed modules run on the CPU, got a tensor on {x.device}")
    return x.detach().to(torch.float32).contiguous().numpy()


def _product(matrix, cols: np.ndarray) -> np.ndarray:
    """W @ cols for cols of shape (n, B): matvec for B == 1, matmat otherwise."""
    if cols.shape[1] == 1:
        return matrix.matvec(cols[:, 0])[:, None]
    return matrix.matmat(cols)


class CompressedLinear(nn.Module):
    """``y = x W^T + b`` with W held as a CER/CSER matrix of shape (out_features, in_features)."""

    def __init__(self, matrix, bias=None):
        super().__init__()
        _check_matrix(matrix)
        self.matrix = matrix
        self.out_features, self.in_features = matrix.shape
        self.register_buffer("bias", _bias_tensor(bias, self.out_features))

    @classmethod
    def from_linear(cls, linear: nn.Linear, matrix) -> CompressedLinear:
        _check_matrix(matrix)
        if tuple(matrix.shape) != tuple(linear.weight.shape):
            raise ValueError(f"matrix shape {matrix.shape} does not match the layer's weight "
                             f"{tuple(linear.weight.shape)}")
        return cls(matrix, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input with {self.in_features} features in the last dimension, "
                             f"got {tuple(x.shape)}")
        lead = x.shape[:-1]
        rows = _as_f32_numpy(x).reshape(-1, self.in_features)
        out = _product(self.matrix, np.ascontiguousarray(rows.T)).T
        y = torch.from_numpy(np.ascontiguousarray(out))
        if isinstance(self.bias, torch.Tensor):
            y += self.bias
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        m = self.matrix
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={m.format_name}, coding={m.coding}, bits/weight={m.bits_per_weight:.3f}")


def _pair(v, what: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(a) for a in v)
    if len(t) != 2:
        raise ValueError(f"{what} must be an int or a pair, got {v!r}")
    return t


class CompressedConv2d(nn.Module):
    """A 2-D convolution (groups=1, zero padding) whose weight is a CER/CSER matrix of the
    (out_channels, in_channels * kh * kw) view, computed by im2col and one matmat per call."""

    def __init__(self, matrix, in_channels: int, kernel_size, *, stride=1, padding=0, dilation=1, bias=None):
        super().__init__()
        _check_matrix(matrix)
        self.matrix = matrix
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.stride = _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.padding = _pair(padding, "padding")
        self.in_channels = int(in_channels)
        self.out_channels = matrix.shape[0]
        kh, kw = self.kernel_size
        if matrix.shape[1] != self.in_channels * kh * kw:
            raise ValueError(f"matrix has {matrix.shape[1]} columns, expected in_channels * kh * kw = "
                             f"{self.in_channels * kh * kw}")
        self.register_buffer("bias", _bias_tensor(bias, self.out_channels))

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, matrix) -> CompressedConv2d:
        _check_matrix(matrix)
        if conv.groups != 1:
            raise ValueError("only groups=1 convolutions can be compressed (depthwise/grouped are not supported)")
        if conv.padding_mode != "zeros":
            raise ValueError(f"only zero padding is supported, got padding_mode={conv.padding_mode!r}")
        out_c, in_c, kh, kw = conv.weight.shape
        if tuple(matrix.shape) != (out_c, in_c * kh * kw):
            raise ValueError(f"matrix shape {matrix.shape} does not match the conv weight view "
                             f"{(out_c, in_c * kh * kw)}")
        padding = conv.padding
        if isinstance(padding, str):
            if padding == "valid":
                padding = (0, 0)
            else:  # "same" (stride 1): symmetric only for odd effective kernel sizes
                eff = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
                if any(e % 2 for e in eff):
                    raise ValueError("padding='same' with an even effective kernel size is not supported")
                padding = tuple(e // 2 for e in eff)
        return cls(matrix, in_c, (kh, kw), stride=conv.stride, padding=padding, dilation=conv.dilation, bias=conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input of shape (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        n, _, h, w = x.shape
        kh, kw = self.kernel_size
        (sh, sw), (ph, pw), (dh, dw) = self.stride, self.padding, self.dilation
        ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        xf = x.detach().to(torch.float32)
        if (kh, kw) == (1, 1) and (sh, sw) == (1, 1) and (ph, pw) == (0, 0):
            cols = xf.reshape(n, self.in_channels, h * w)
        else:
            cols = F.unfold(xf, self.kernel_size, dilation=self.dilation, padding=self.padding, stride=self.stride)
        # (N, C*kh*kw, L) -> (C*kh*kw, N*L): every output position is one column of the batch.
        big = cols.permute(1, 0, 2).reshape(cols.shape[1], -1)
        out = _product(self.matrix, _as_f32_numpy(big))  # (out_channels, N*L)
        y = torch.from_numpy(out).reshape(self.out_channels, n, ho * wo).permute(1, 0, 2)
        if isinstance(self.bias, torch.Tensor):
            y = y + self.bias.reshape(1, -1, 1)
        return y.reshape(n, self.out_channels, ho, wo).contiguous().to(x.dtype)

    def extra_repr(self) -> str:
        m = self.matrix
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, bias={self.bias is not None}, "
                f"format={m.format_name}, coding={m.coding}, bits/weight={m.bits_per_weight:.3f}")


def compress_module(model: nn.Module, data, *, formats: str = "cser", coding: str = "auto",
                    load_state: bool = True) -> list[str]:
    """Replace, in place, every ``nn.Linear`` and ``nn.Conv2d`` (groups=1, zero padding) of ``model``
    whose ``<name>.weight`` is a quantized tensor of the stream ``data`` by a compressed module.

    With ``load_state`` (the default) the stream's decoded tensors are first loaded into the model
    (``load_state_dict(strict=False)`` over the names both share), so biases, norms and any layer
    left dense hold the stream's values too. Returns the names of the replaced modules.
    """
    from ..model.decoder import decode_checkpoint

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if load_state:
        own = model.state_dict()
        tensors = decode_checkpoint(data).tensors
        state = {k: torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v
                 for k, v in tensors.items() if k in own}
        model.load_state_dict(state, strict=False)
    targets = []
    for name, module in model.named_modules():
        if not name:  # the model itself cannot be swapped in place
            continue
        if isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1
                                             and module.padding_mode == "zeros"):
            targets.append((name, module))
    wanted = [f"{name}.weight" for name, _ in targets]
    matrices = from_stream(data, formats, coding=coding, names=wanted)
    replaced = []
    for name, module in targets:
        mat = matrices.get(f"{name}.weight")
        if mat is None or tuple(mat.tensor_shape) != tuple(module.weight.shape):
            continue
        new = (CompressedLinear.from_linear(module, mat) if isinstance(module, nn.Linear)
               else CompressedConv2d.from_conv(module, mat))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced.append(name)
    return replaced
