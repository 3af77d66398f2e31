"""Whole models: the encoder and decoder of model streams and every policy they apply.

May import: ``io``, ``entropy``, ``quant``, ``errors``. Nothing here calls ``encode_model`` from
below it: workflows around the encoder live in ``tuning``.

* :mod:`.encoder` / :mod:`.decoder`: ``encode_model``, ``write_stream``, ``quantize_model`` /
  ``decode_model``, ``iter_decoded``, ``decode_checkpoint``, ``decode_levels``, ``read_stream_header``.
* :mod:`.files`: stream files and directories from checkpoint files and directories (and back) in
  bounded memory: ``encode_file``, ``decode_file``, ``encode_directory``, ``decode_directory``.
* :mod:`.parallel`: threads, progress and how many elements are in flight.
* :mod:`.settings`: :class:`EncodeSettings`, the defaults.
* :mod:`.model_plan` / :mod:`.tensor_plan`: what is coded how (allocation, BatchNorm treatment,
  bias correction; per tensor: mode, chunk layout, quantizer, importance).
* :mod:`.container`: the stream's header and tensor table (``docs/format.md``).
* :mod:`.structural_importance`, :mod:`.batchnorm`, :mod:`.allocation`: the data-free policies.
* :mod:`.optimizer_state`: which tensors are an optimizer's moments and steps.
* :mod:`.levels`: :class:`QuantizedTensor`; :mod:`.report`: sizes, ratios and errors.
"""
