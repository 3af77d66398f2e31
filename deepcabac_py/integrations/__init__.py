"""Adapters to other engines, each behind its own extra: PyTorch DDP (``ddp``), Flower
(``flower``), zarr/numcodecs (``zarr_codec``), PyTorch Lightning (``lightning_io``: a ``CheckpointIO``
writing a checkpoint series), the Hugging Face Trainer (``hf_trainer``: a callback adding every
``checkpoint-N/`` it saves to a series; extra ``hf``).

May import: anything below ``cli``.
"""
