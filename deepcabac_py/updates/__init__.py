"""Weight updates of distributed and federated training: sparsified, coded against their parent.

May import: ``model`` (the stream preamble, and whole-model messages of the federated helpers),
``entropy`` (the range coder), ``io``, ``errors``.

* :mod:`.sparsify`: STC, SBC, top-k, structured rows, error feedback.
* :mod:`.messages`: update messages and sessions (``encode_update``, ``apply_update``, ...).
* :mod:`.golomb`: the STC/SBC papers' Golomb position code (baseline and coder option).
* :mod:`.federated`: client and server helpers for both directions of a federated round.
"""
