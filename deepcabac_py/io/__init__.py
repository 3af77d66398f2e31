"""Checkpoints in and out: what a checkpoint is, its files, dtypes, and atomic output.

May import: ``errors`` and ``_jit`` (it is the bottom layer; torch is imported by ``checkpoint``
and ``files``, never by ``dtypes``, ``atomic`` or ``inputs``).

* :mod:`.checkpoint`: :class:`Checkpoint` (flat tensors plus the structure around them),
  ``flatten``/``unflatten``, tensor <-> numpy carrier arrays.
* :mod:`.files`: ``load_checkpoint``/``save_checkpoint`` for ``.pt``/``.pth``/``.bin``,
  safetensors and ``.npz``, weights-only and bounded.
* :mod:`.tensor_source`: a checkpoint's table up front and its tensors one at a time
  (safetensors straight from disk), what the streaming encoder reads.
* :mod:`.directories`: Hugging Face checkpoint directories (shards, index, carried files), checked
  and replaced in one rename; a whole directory (a Trainer's ``checkpoint-N/``) as one checkpoint.
* :mod:`.dtypes`: dtype names, their frozen codes in the bitstreams, their numpy carriers.
* :mod:`.atomic`: ``write_atomic`` and the wording of operating-system errors.
* :mod:`.inputs`: one error and one wording for a file that cannot be read.
* :mod:`.checksum`: the formats' CRC-32 (zlib's; large buffers by carry-less multiplication in
  a kernel of its own where the processor has VPCLMULQDQ but not AVX-512, else ISA-L's when
  installed).
* :mod:`.buffers`: large ``bytes`` joined in huge pages where the system gives them on request.
"""
