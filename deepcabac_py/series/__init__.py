"""Checkpoint series: the checkpoints of a training run in one file, each coded against the last.

May import: ``model`` (the encoder and decoder of each entry), ``quant`` (its processor-independent
log2, exp2 and dot product), ``io``, ``errors``, ``_jit`` (its kernels).

* :mod:`.records`: the ``.dcs`` file: records appended atomically, one writer at a time.
* :mod:`.checkpoint_series`: :class:`CheckpointSeries` (``append``, ``len``, ``[i]``): key entries
  on their own, the others as residuals against the previous *reconstructed* entry.
* :mod:`._series_kernels` (private): its arithmetic over whole tensors, one pass per expression.
"""
