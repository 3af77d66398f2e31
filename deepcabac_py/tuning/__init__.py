"""Workflows around the encoder that use data or several encodes: Fisher importance, rate control,
BatchNorm recalibration.

May import: ``model`` (they call ``encode_model``/``decode_model``), ``io``, ``errors``.

* :mod:`.fisher`: ``diagonal_fisher``, per-weight importance from a loss and calibration batches.
* :mod:`.rate_control`: ``encode_to_size``, ``encode_for_fidelity``.
* :mod:`.recalibration`: ``recalibrate``, ``encode_recalibrated``.
"""
