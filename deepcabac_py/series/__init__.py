"""Checkpoint series: the checkpoints of a training run in one file, each coded against the last.

May import: ``model`` (the encoder and decoder of each entry), ``quant`` (its processor-independent
log2, exp2 and dot product), ``io``, ``errors``, ``_jit`` (its kernels).

* :mod:`.records`: the ``.dcs`` file: records appended atomically, one writer at a time.
* :mod:`.checkpoint_series`: :class:`CheckpointSeries` (``append``, ``len``, ``[i]``): key entries
  on their own, the others as residuals against the previous *reconstructed* entry. What an entry
  is made of, below it:

  * :mod:`.moments`: the optimizer's moments, the direction of their step, the update domain;
  * :mod:`.steps`: each weight's first moment (its pairing) and the size of its step (its qp);
  * :mod:`.predictions`: a weight's change as the step directions predict it;
  * :mod:`.changes`: a residual entry's tensors as differences and log2 ratios, and back;
  * :mod:`.bit_residuals`: a lossless series' residuals on the float bits, and back;
  * :mod:`.coding`: an entry, or some of its tensors alone, through the model coder;
  * :mod:`.arrays`: tensors as the kernels read and write them;
  * :mod:`.carried_files`: a directory entry's files against its parent's.
* :mod:`._series_kernels` (private): its arithmetic over whole tensors, one pass per expression.
"""
