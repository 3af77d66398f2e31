"""Entropy-bounded matrix formats: quantized weights whose size and dot-product cost shrink with
the matrix entropy (CER, compressed entropy row; CSER, compressed shared elements row).

May import: ``model`` (levels from a stream), ``quant``, ``errors``.

* :mod:`.formats`: :class:`CERMatrix`, :class:`CSERMatrix`, ``from_stream``, sizes per format.
* :mod:`.torch_modules`: ``CompressedLinear``/``CompressedConv2d`` and ``compress_module``.
"""
