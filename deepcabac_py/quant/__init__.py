"""Quantization: the step of ``qp``, the three quantizers (nearest, RDOQ, trellis) and every
reconstruction of levels into values.

May import: ``errors``, ``_jit``, ``io.dtypes`` and ``entropy`` (the RD quantizers price levels with
the level coder's own modelling).

* :mod:`.steps`: ``step_from_qp``, ``qp_for_range``, the qp range.
* :mod:`.quantizers`: levels of a chunk by nearest rounding, RDOQ or the trellis.
* :mod:`.reconstruct`: levels back to values, dependent quantization's state machine included.
* :mod:`.log_domain`: values by the log2 of their magnitudes (an optimizer's moments).
* :mod:`.portable`: log2, exp2 and dot products whose last bits no processor changes, for
  what is written from them.
"""
