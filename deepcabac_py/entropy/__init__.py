"""Entropy coding of integer levels: the context-adaptive binary arithmetic coder and the linear
prediction across columns whose residuals it codes; and the lossless coder of float bits and wide
integers (static per-class tables, rANS).

May import: ``errors`` and ``_jit``. The range coder and modelling kernels in ``_cabac_kernels``
are shared with the quantizers (which price levels with the coder's own contexts) and with the
update coder (which reuses the range coder).

* :mod:`.chunk_layout`: how a tensor is cut into substreams and the ``coder_param`` byte (format).
* :mod:`.levelcoder`: ``encode_chunk``/``decode_chunk``, the validated front of the kernels.
* :mod:`.linear_prediction`: pivots, integer coefficients and the exact residual arithmetic.
* :mod:`.floatcoder`: ``encode_chunk``/``decode_chunk`` (floats bit for bit) and
  ``encode_magnitudes``/``decode_magnitudes`` (signed integers by magnitude class), the validated
  front of its kernels: ``_float_kernels`` (the split, the classes, the tables, rANS),
  ``_tans_kernels`` (the symbols by tANS: low-bit modes 0, 1 and 3), ``_trailing_kernels`` (mode 2),
  ``_wide_kernels`` (modes 4 to 6, sixteen lanes at a time, on ``_vector_kernels``' steps) and
  ``_magnitude_kernels`` (integers).
"""
