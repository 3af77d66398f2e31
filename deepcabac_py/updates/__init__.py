"""Weight updates of distributed and federated training: sparsified, coded against their parent.

May import: ``model`` (the stream preamble, and whole-model messages of the federated helpers),
``entropy`` (the range coder), ``io``, ``errors``.

* :mod:`.sparsify`: STC, SBC, top-k, structured rows, error feedback.
* :mod:`.messages`: update messages (``encode_update``, ``decode_update``, ``apply_update``, a
  stream of rounds), on:

  * :mod:`.message_format`: the format's codes and header, written and read;
  * :mod:`.sessions`: :class:`UpdateSession`, what each end remembers between messages;
  * :mod:`.parent_model`: the parent's tensors in name order and its SHA-256.
* :mod:`.golomb`: the STC/SBC papers' Golomb position code (baseline and coder option).
* :mod:`.federated`: client and server helpers for both directions of a federated round.
"""
