"""Adapters to other engines, each behind its own extra: PyTorch DDP (``ddp``), Flower
(``flower``), zarr/numcodecs (``zarr_codec``).

May import: anything below ``cli``.
"""
