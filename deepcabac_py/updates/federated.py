"""Both directions of sparse federated updates: client and server helpers around update messages.

* :class:`FedClient` keeps the global model it last synchronised to, an error-feedback residual and
  two sessions: an encoder session for its upstream messages and a decoder session that follows the
  server's downstream stream.
* :class:`FedServer` decodes each client's upstream message with that client's decoder session
  (the message must name the current global model as its parent), averages the updates, adds its
  own error-feedback residual, re-sparsifies and encodes the aggregate once as the downstream
  message of the round, and applies exactly that to the global model (so every client that applies
  the same messages holds bit-identical weights).
* Partial participation: :meth:`FedServer.catch_up` gives a client that missed rounds the messages it
  missed (the accumulated update, exactly, and the contexts its decoder session needs), or the full
  model plus a snapshot of the downstream session when that is smaller.

Models are flat mappings ``name -> numpy array or torch tensor``; integer tensors are carried
exactly, float tensors through ``method`` at ``density``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UpdateMismatchError
from ..io.checksum import crc32
from .messages import apply_delta, decode_update, encode_sparse, update_difference
from .parent_model import flat_model, hash_flat
from .sessions import UpdateSession
from .sparsify import ErrorFeedback, SparseTensor, sparsify

DOWNSTREAM_SESSION = 0xD0D0


def _numpy_model(model) -> dict[str, np.ndarray]:
    return {n: t.array.copy() for n, t in flat_model(model).items()}


@dataclass
class CatchUp:
    """What a lagging client downloads: the missed messages, or the full model and session."""

    messages: list[bytes]
    full_model: dict[str, np.ndarray] | None = None
    session_snapshot: bytes | None = None
    round: int = 0

    @property
    def nbytes(self) -> int:
        if self.full_model is not None:
            return _full_model_bytes(self.full_model) + len(self.session_snapshot or b"")
        return sum(len(m) for m in self.messages)


def _full_model_bytes(model: Mapping[str, np.ndarray]) -> int:
    return sum(int(np.asarray(v).nbytes) for v in model.values())


def check_server_lr(server_lr) -> float:
    """``server_lr`` as a float, or ``ValueError`` unless it is a positive finite number."""
    if not (isinstance(server_lr, (int, float, np.floating, np.integer)) and 0.0 < float(server_lr) < math.inf):
        raise ValueError(f"server_lr must be positive and finite, got {server_lr!r}")
    return float(server_lr)


class FedServer:
    """The aggregator. ``coder`` is ``"cabac"`` (ours, with sessions) or ``"golomb"``.

    ``down_density`` (default ``density``) is the density of the re-sparsified aggregate sent
    downstream: the mean of K client updates of density d has up to K*d nonzeros, so a downstream
    density of about K*d passes the round's aggregate on instead of holding most of it back in the
    server's residual. ``server_lr`` scales the averaged update before it is re-sparsified (a server
    learning rate, as in FedOpt); 1 is plain FedAvg."""

    def __init__(self, model, *, density: float = 0.01, method: str = "stc", coder: str = "cabac",
                 feedback: bool = True, keep_messages: int = 10_000, down_density: float | None = None,
                 server_lr: float = 1.0):
        self.server_lr = check_server_lr(server_lr)
        self.model = _numpy_model(model)
        self.round = 0
        self.density, self.method, self.coder = density, method, coder
        self.down_density = density if down_density is None else down_density
        self.feedback = ErrorFeedback() if feedback else None
        self.down_session = UpdateSession(DOWNSTREAM_SESSION) if coder == "cabac" else None
        self.up_sessions: dict[int, UpdateSession] = {}
        self.messages: dict[int, bytes] = {}  # downstream message that produced round r (parent r - 1)
        self.keep_messages = keep_messages
        self._pending: list[dict[str, np.ndarray]] = []
        self._hash = hash_flat(flat_model(self.model))

    def receive(self, client_id: int, data: bytes) -> dict[str, np.ndarray]:
        """Decode one client's upstream message against the current global model; returns its delta."""
        session = None
        if self.coder == "cabac":
            session = self.up_sessions.setdefault(client_id, UpdateSession(1 + client_id))
        upd = decode_update(data, self.model, session=session)
        if upd.header.parent_round != self.round:
            raise UpdateMismatchError(f"client {client_id} sent an update for round {upd.header.parent_round}, "
                                      f"the server is at round {self.round}")
        delta = upd.delta()
        self._pending.append(delta)
        return delta

    def aggregate(self) -> bytes:
        """Average the received deltas, re-sparsify with error feedback, encode and apply the
        downstream message; returns it. The global model moves to ``round + 1``."""
        if not self._pending:
            raise ValueError("no client update was received this round")
        names = [n for n in self.model if self.model[n].dtype.kind == "f"]
        mean = {}
        for n in names:
            parts = [d[n].astype(np.float64) for d in self._pending if n in d]
            # (0-d tensors: arithmetic on 0-d arrays gives numpy scalars, hence asarray)
            mean[n] = np.asarray(sum(parts) * (self.server_lr / len(self._pending))) if parts \
                else np.zeros(self.model[n].shape)

        def compress(name: str, acc: np.ndarray) -> SparseTensor:
            return sparsify(acc, self.method, self.down_density)

        sent = self.feedback.step(mean, compress) if self.feedback is not None else \
            {n: compress(n, a) for n, a in mean.items()}
        sparse: dict[str, Any] = dict(sent)
        ints = [n for n in self.model if self.model[n].dtype.kind in "iu"]
        for n in ints:  # integer tensors (counters): the first client's exact value
            d = self._pending[0].get(n)
            if d is not None:
                sparse[n] = d.astype(np.int64)
        data = encode_sparse(sparse, self.model, round_index=self.round + 1, parent_round=self.round,
                             session=self.down_session, coder=self.coder, parent_hash=self._hash,
                             table=False)  # both ends hold the model: no tensor table, whatever the coder
        from .message_format import read_update_header
        from .messages import Update

        # Exactly what a client applies: the tensors the message carries (all-zero ones are not sent).
        carried = {n: s for n, s in sparse.items()
                   if (s.nnz if isinstance(s, SparseTensor) else int(np.count_nonzero(s)))}
        upd = Update(read_update_header(data), carried)
        self.model = {n: np.asarray(v) for n, v in apply_delta(self.model, upd).items()}
        self._hash = hash_flat(flat_model(self.model))
        self.round += 1
        self.messages[self.round] = data
        self.messages.pop(self.round - self.keep_messages, None)
        self._pending = []
        return data

    def catch_up(self, client_round: int) -> CatchUp:
        """What a client synchronised at ``client_round`` needs to reach the current round: the
        missed downstream messages, or the full model (+ session snapshot) when that is smaller or
        when messages were dropped."""
        missed = list(range(client_round + 1, self.round + 1))
        have_all = all(r in self.messages for r in missed)
        msgs = [self.messages[r] for r in missed] if have_all else []
        full_size = _full_model_bytes(self.model)
        if have_all and sum(len(m) for m in msgs) <= full_size:
            return CatchUp(msgs, round=self.round)
        snap = self.down_session.snapshot() if self.down_session is not None else b""
        if have_all and sum(len(m) for m in msgs) <= full_size + len(snap):
            return CatchUp(msgs, round=self.round)
        return CatchUp([], {n: v.copy() for n, v in self.model.items()}, snap, round=self.round)


class FedClient:
    """One participant. ``local_model`` given to :meth:`upstream` is the model after local training
    started from :attr:`model` (the global model of round :attr:`round`)."""

    def __init__(self, client_id: int, model, *, density: float = 0.01, method: str = "stc", coder: str = "cabac",
                 feedback: bool = True):
        self.client_id = client_id
        self.model = _numpy_model(model)
        self.round = 0
        self.density, self.method, self.coder = density, method, coder
        self.feedback = ErrorFeedback() if feedback else None
        self.up_session = UpdateSession(1 + client_id) if coder == "cabac" else None
        self.down_session = UpdateSession(DOWNSTREAM_SESSION) if coder == "cabac" else None
        self.downloaded = 0  # bytes

    def sync(self, catch: CatchUp) -> None:
        """Apply a :class:`CatchUp` from the server."""
        if catch.full_model is not None:
            self.model = {n: v.copy() for n, v in catch.full_model.items()}
            if self.coder == "cabac":
                if catch.session_snapshot is None:
                    raise UpdateMismatchError("a catch-up with the full model carries no downstream session snapshot")
                self.down_session = UpdateSession.from_snapshot(catch.session_snapshot)
        else:
            for m in catch.messages:
                upd = decode_update(m, self.model, session=self.down_session)
                self.model = {n: np.asarray(v) for n, v in apply_delta(self.model, upd).items()}
        self.round = catch.round
        self.downloaded += catch.nbytes

    def upstream(self, local_model) -> bytes:
        """Sparsify ``local_model - model`` with error feedback and encode it for the server."""
        diff = update_difference(local_model, self.model)
        floats = {n: d for n, d in diff.items() if self.model[n].dtype.kind == "f"}

        def compress(name: str, acc: np.ndarray) -> SparseTensor:
            return sparsify(acc, self.method, self.density)

        sent = self.feedback.step(floats, compress) if self.feedback is not None else \
            {n: compress(n, a) for n, a in floats.items()}
        sparse: dict[str, Any] = dict(sent)
        sparse.update({n: d for n, d in diff.items() if self.model[n].dtype.kind in "iu"})
        return encode_sparse(sparse, self.model, round_index=self.round + 1, parent_round=self.round,
                             session=self.up_session, coder=self.coder, table=False)


def crc_of_model(model) -> int:
    """A cheap fingerprint of a model (for tests and logs)."""
    crc = 0
    for n, t in flat_model(model).items():
        crc = crc32(n.encode() + t.array.tobytes(), crc)
    return crc
