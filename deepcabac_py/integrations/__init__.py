"""Adapters to other engines, each behind its own extra: PyTorch DDP (``ddp``), Flower
(``flower``), zarr/numcodecs (``zarr_codec``), PyTorch Lightning (``lightning_io``: a ``CheckpointIO``
writing a checkpoint series).

May import: anything below ``cli``.
"""
