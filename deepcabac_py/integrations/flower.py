"""Flower integration: sparse update streams through Flower's Message API (flwr >= 1.20).

Two pieces that work together:

* :func:`deepcabac_mod`, a client-side Flower *Mod*. Around the user's unchanged ``@app.train()`` /
  ``@app.evaluate()`` functions it turns the server's compressed downstream message back into the
  ordinary ``ArrayRecord`` of the global model, and turns the trained model in the train reply into
  one update message (STC/SBC levels against the global model, error feedback, our coder with a
  session) that travels as bytes.
* :class:`DeepCabacStrategy`, a server strategy (a :class:`flwr.serverapp.strategy.FedAvg` whose
  transport and aggregation are those of :class:`deepcabac_py.updates.federated.FedServer`): it decodes the
  updates, averages them, re-sparsifies the mean with its own error feedback and sends every sampled
  client only the downstream messages it missed (or the full model and a session snapshot when
  that is smaller, or when the client is new).

::

    from flwr.clientapp import ClientApp
    from deepcabac_py.integrations.flower import DeepCabacStrategy, deepcabac_mod

    app = ClientApp(mods=[deepcabac_mod])          # train/evaluate functions as for FedAvg
    strategy = DeepCabacStrategy(density=0.01)      # in the ServerApp: strategy.start(grid=..., ...)

The client keeps its synchronised model, residual and coding sessions in ``context.state`` (Flower
persists it per node between rounds). The strategy is the authority on the settings (density,
method, coder): they travel with every message, so the mod takes no arguments. What travels:

* server to client: a ``ConfigRecord`` ``"deepcabac"`` with the client's id, the round, the
  SHA-256 of the global model (checked after the update is applied), the missed messages as
  ``bytes``, and only for a full download the model (a lossless deepcabac model stream: Flower's
  ``ArrayRecord`` turns 0-d arrays into 1-d ones on the wire) plus the session snapshot;
* client to server (train): the same ``ConfigRecord`` key holding ``"update"``, one update message
  (``docs/format.md``, "Update streams"), in place of the model's ``ArrayRecord``. Metrics are
  untouched.

Aggregation is the plain mean of the clients' updates (as in the STC paper and ``FedServer``), not
weighted by ``num-examples``; metrics are still aggregated the FedAvg way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from ..errors import DeepCabacError, FormatError, UpdateMismatchError
from ..model.decoder import decode_checkpoint
from ..model.encoder import encode_model
from ..updates.federated import CatchUp, FedClient, FedServer, check_server_lr
from ..updates.message_format import read_update_header
from ..updates.parent_model import model_hash
from ..updates.sessions import UpdateSession
from ..updates.sparsify import METHODS

__all__ = ["KEY", "DeepCabacStrategy", "deepcabac_mod", "make_deepcabac_mod"]

KEY = "deepcabac"  # the ConfigRecord both ends exchange in messages
STATE = f"{KEY}.state"  # the ConfigRecord the mod keeps in the client's context.state
_CODERS = ("cabac", "golomb")

# A child of Flower's logger: our lines come out with Flower's own formatting and level.
_T = TypeVar("_T")
_log = logging.getLogger("flwr.deepcabac")


# --------------------------------------------------------------------------------------------------
# client side
# --------------------------------------------------------------------------------------------------


def _numpy_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def _array_record(model: Mapping[str, np.ndarray], order: Sequence[str]) -> ArrayRecord:
    # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
    return ArrayRecord({k: Array(np.require(model[k], requirements="C")) for k in order})


def _pack(model: Mapping[str, np.ndarray]) -> bytes:
    """Tensors as a lossless model stream: exact dtypes and shapes (0-d included), in order."""
    return encode_model(dict(model), keep_exact=True, threads=1)


def _unpack(data) -> dict[str, np.ndarray]:
    # (a stream packed from numpy arrays decodes to numpy arrays)
    return {k: np.asarray(v) for k, v in decode_checkpoint(bytes(data), threads=1).tensors.items()}


def _field(cfg: ConfigRecord, key: str, kind: type[_T]) -> _T:
    """``cfg[key]`` if it holds a ``kind`` (the strategy and the Mod write them), else FormatError."""
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"deepcabac: config field {key!r} holds {type(value).__name__}, not {kind.__name__}")
    return value


def _session_from(blob: bytes) -> UpdateSession | None:
    return UpdateSession.from_snapshot(blob) if blob else None


def _load_client(state: RecordDict, cfg: ConfigRecord) -> tuple[FedClient, list[str]] | None:
    """The client as the previous round left it, under the settings the server sends now."""
    saved = state.config_records.get(STATE)
    if saved is None or _field(saved, "client-id", int) != _field(cfg, "client-id", int):
        return None  # first contact, or the server gave this node another identity: start over
    model = _unpack(_field(saved, "model", bytes))
    client = _new_client(cfg, model)
    client.round = _field(saved, "round", int)
    client.up_session = _session_from(_field(saved, "up-session", bytes))
    client.down_session = _session_from(_field(saved, "down-session", bytes))
    if client.feedback is not None and "residual" in saved:
        residual = _unpack(_field(saved, "residual", bytes))
        client.feedback.residual = {k: v.astype(np.float64) for k, v in residual.items()}
    return client, list(model)


def _new_client(cfg: ConfigRecord, model: Mapping[str, Any]) -> FedClient:
    return FedClient(_field(cfg, "client-id", int), model, density=_field(cfg, "density", float),
                     method=_field(cfg, "method", str), coder=_field(cfg, "coder", str),
                     feedback=_field(cfg, "feedback", bool))


def _save_client(state: RecordDict, client: FedClient, order: list[str]) -> None:
    saved: dict[str, Any] = {
        "client-id": client.client_id,
        "round": client.round,
        "model": _pack({k: client.model[k] for k in order}),
        "up-session": client.up_session.snapshot() if client.up_session is not None else b"",
        "down-session": client.down_session.snapshot() if client.down_session is not None else b"",
    }
    if client.feedback is not None and client.feedback.residual:
        saved["residual"] = _pack(client.feedback.residual)
    state[STATE] = ConfigRecord(saved)


def _sync(state: RecordDict, cfg: ConfigRecord,
          initial: Callable[[], Mapping[str, Any]] | Mapping[str, Any] | None) -> tuple[FedClient, list[str]]:
    """Bring the client to the server's round with what the message carries."""
    loaded = _load_client(state, cfg)
    target = _field(cfg, "round", int)
    if "model" in cfg:  # full download: the model and the downstream session
        model = _unpack(_field(cfg, "model", bytes))
        client = loaded[0] if loaded is not None else _new_client(cfg, model)
        order = list(model)
        client.sync(CatchUp([], model, _field(cfg, "snapshot", bytes), round=target))
    else:
        if loaded is None:
            if initial is None:
                raise UpdateMismatchError(
                    "deepcabac_mod: the server assumes this client holds the initial model "
                    "(clients_hold_initial=True) but none was given: use make_deepcabac_mod(initial=...)")
            given = initial() if callable(initial) else initial
            loaded = (_new_client(cfg, given), list(given.keys()))
        client, order = loaded
        # The server counts a client as synchronised only when its reply arrives; after a lost reply
        # it resends messages this client already applied (its sessions moved on with them).
        sent = _field(cfg, "messages", list) if "messages" in cfg else []
        messages = [bytes(m) for m in sent if read_update_header(m).round > client.round]
        client.sync(CatchUp(messages, round=target))
    if model_hash(client.model) != _field(cfg, "model-hash", bytes):
        raise UpdateMismatchError(
            f"deepcabac_mod: after applying round {target} this client's model differs from the server's "
            "(with clients_hold_initial=True: is make_deepcabac_mod's initial model the server's?)")
    up_seq = _field(cfg, "up-seq", int)
    if client.up_session is not None and client.up_session.seq != up_seq:
        # An upstream message was lost after this client coded it: both ends restart the stream
        # (the server does the same when a message starts a session it had advanced).
        client.up_session = UpdateSession(client.up_session.session_id)
    return client, order


def make_deepcabac_mod(initial: Callable[[], Mapping[str, Any]] | Mapping[str, Any] | None = None):
    """A :func:`deepcabac_mod` for clients that already hold the initial model.

    With ``DeepCabacStrategy(clients_hold_initial=True)`` a new client downloads only the
    messages since round 0 (as in :mod:`deepcabac_py.updates.federated`, where every client starts from the
    same model) instead of the full model; ``initial`` is that model (a flat mapping of tensors or
    a function returning one, e.g. the network built from a shared seed). The server's model hash
    is checked after the update is applied, so a different initial model is refused.
    """

    def mod(msg: Message, context: Context, call_next) -> Message:
        return _run_mod(msg, context, call_next, initial)

    mod.__name__ = mod.__qualname__ = "deepcabac_mod"
    return mod


def deepcabac_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower Mod: compressed downstream in, one update message upstream (see the module docs).

    Messages that do not come from :class:`DeepCabacStrategy` pass through untouched.
    """
    return _run_mod(msg, context, call_next, None)


def _run_mod(msg: Message, context: Context, call_next, initial) -> Message:
    if not msg.has_content() or KEY not in msg.content.config_records:
        return call_next(msg, context)
    cfg = msg.content.config_records[KEY]
    client, order = _sync(context.state, cfg, initial)
    arrays_key = _field(cfg, "arrays-key", str)
    # What the user's function sees is exactly a FedAvg message: the model and the other records.
    inner = RecordDict({k: v for k, v in msg.content.items() if k not in (KEY, arrays_key)})
    inner[arrays_key] = _array_record(client.model, order)
    msg.content = inner
    try:
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        category = msg.metadata.message_type.split(".")[0]
        out: dict[str, Any] = {"client-id": client.client_id, "round": client.round}
        if category == MessageType.TRAIN:
            out["update"] = _upstream(client, reply.content)
        reply.content[KEY] = ConfigRecord(out)
        return reply
    finally:
        _save_client(context.state, client, order)


def _upstream(client: FedClient, content: RecordDict) -> bytes:
    records = content.array_records
    if len(records) != 1:
        raise ValueError(f"deepcabac_mod: a train reply must carry exactly one ArrayRecord (the trained model), "
                         f"found {len(records)}")
    key, record = next(iter(records.items()))
    local = _numpy_record(record)
    if set(local) != set(client.model):
        missing = sorted(set(local) ^ set(client.model))
        raise ValueError(f"deepcabac_mod: the trained model's arrays differ from the global model's: {missing[:5]}")
    # An ArrayRecord that crossed Flower's wire holds 0-d arrays as 1-d: same values, other shape.
    local = {k: v.reshape(client.model[k].shape) if v.shape != client.model[k].shape
             and v.size == client.model[k].size else v for k, v in local.items()}
    data = client.upstream(local)
    del content[key]  # the update replaces the model: this is the whole point
    return data


# --------------------------------------------------------------------------------------------------
# server side
# --------------------------------------------------------------------------------------------------


class DeepCabacStrategy(FedAvg):
    """FedAvg's sampling and metrics with sparse update streams in both directions.

    ``density``, ``method`` (``"stc"``, ``"sbc"``, ``"topk"``), ``coder`` (``"cabac"``: ours, with
    sessions; ``"golomb"``: the STC papers' position code, ternary levels only, so integer tensors
    may move by at most 1 a round), ``feedback`` (error feedback on both ends) and
    ``keep_messages`` and ``server_lr`` (a server learning rate: the averaged update is scaled by it
    before it is re-sparsified) are those of :class:`~deepcabac_py.updates.federated.FedServer`.
    ``clients_hold_initial`` lets new clients build their model from the messages since round 0
    (their mod needs ``make_deepcabac_mod(initial=...)``); otherwise a new client downloads the full
    model once. ``client_ids`` maps Flower node ids to small integers (the session ids; by default
    they are given in order of first contact); ``sample_fn(server_round, node_ids)`` chooses the
    training nodes instead of FedAvg's ``fraction_train`` sampling. ``measure_wire=True`` also
    records the size of every message as Flower serialises it (one extra serialisation, through
    Flower's internal object tree: checked with flwr 1.42).
    Every other keyword goes to :class:`~flwr.serverapp.strategy.FedAvg`.

    Traffic is in :attr:`traffic` (totals) and :attr:`rounds` (one entry per round); the byte
    counts are those of :mod:`deepcabac_py.updates.federated` (messages, or fp32 model plus snapshot),
    comparable with ``benchmarks/fl_simulation.py``.
    """

    def __init__(self, *, density: float = 0.01, method: str = "stc", coder: str = "cabac", feedback: bool = True,
                 keep_messages: int = 10_000, server_lr: float = 1.0, clients_hold_initial: bool = False,
                 client_ids: Mapping[int, int] | None = None,
                 sample_fn: Callable[[int, list[int]], Iterable[int]] | None = None,
                 measure_wire: bool = False, **fedavg_kwargs: Any) -> None:
        super().__init__(**fedavg_kwargs)
        if not (isinstance(density, (int, float)) and 0.0 < float(density) <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if coder not in _CODERS:
            raise ValueError(f"coder must be one of {_CODERS}, got {coder!r}")
        if coder == "golomb" and method == "topk":
            raise ValueError("the Golomb coder carries ternary levels only: use method='stc' or 'sbc'")
        self.server_lr = check_server_lr(server_lr)  # now, not when the first round starts
        self.density, self.method, self.coder = float(density), method, coder
        self.feedback, self.keep_messages = bool(feedback), int(keep_messages)
        self.clients_hold_initial = bool(clients_hold_initial)
        self.sample_fn = sample_fn
        self.measure_wire = bool(measure_wire)
        self._given_ids = dict(client_ids or {})
        ids = list(self._given_ids.values())
        if len(set(ids)) != len(ids) or any(not (isinstance(i, int) and 0 <= i < (1 << 31)) for i in ids):
            raise ValueError("client_ids must map node ids to distinct integers in [0, 2**31)")
        self._reset()

    def _reset(self) -> None:
        self.server: FedServer | None = None
        self._order: list[str] = []
        self._ids: dict[int, int] = dict(self._given_ids)
        self._node_round: dict[int, int] = {}  # node -> the round its model is known to be at
        self._hash: tuple[int, bytes] | None = None
        self.traffic = {"up": 0, "down": 0, "full_downloads": 0, "wire_up": 0, "wire_down": 0}
        self.rounds: list[dict[str, int]] = []

    def summary(self) -> None:
        _log.info("\t├──> deepcabac: %s at density %g, coder %s, error feedback %s, server learning rate %g, "
                  "clients hold the initial model: %s", self.method, self.density, self.coder, self.feedback,
                  self.server_lr, self.clients_hold_initial)
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any):
        """As :meth:`FedAvg.start`; the global model starts from ``initial_arrays`` at round 0."""
        self._reset()
        self._ensure_server(initial_arrays)
        return super().start(grid, initial_arrays, *args, **kwargs)

    # -- state -------------------------------------------------------------------------------------

    @property
    def _fed(self) -> FedServer:
        """The server side of the federated round (made by ``start`` or the first configure call)."""
        if self.server is None:
            raise RuntimeError("DeepCabacStrategy: the federated server is made by start() or configure_train()")
        return self.server

    def _ensure_server(self, arrays: ArrayRecord) -> FedServer:
        if self.server is None:
            self._order = list(arrays.keys())
            self.server = FedServer(_numpy_record(arrays), density=self.density, method=self.method,
                                    coder=self.coder, feedback=self.feedback, keep_messages=self.keep_messages,
                                    server_lr=self.server_lr)
        return self.server

    def _client_id(self, node: int) -> int:
        cid = self._ids.get(node)
        if cid is None:
            used = set(self._ids.values())
            cid = next(i for i in range(len(used) + 1) if i not in used)
            self._ids[node] = cid
        return cid

    def _model_hash(self) -> bytes:
        if self._hash is None or self._hash[0] != self._fed.round:
            self._hash = (self._fed.round, model_hash(self._fed.model))
        return self._hash[1]

    def global_arrays(self) -> ArrayRecord:
        """The current global model as an ArrayRecord, in the initial model's key order."""
        return _array_record(self._fed.model, self._order)

    def _round_entry(self, server_round: int) -> dict[str, int]:
        if not self.rounds or self.rounds[-1]["round"] != server_round:
            self.rounds.append({"round": server_round, "up": 0, "down": 0, "full_downloads": 0, "wire_up": 0,
                                "wire_down": 0, "clients": 0})
        return self.rounds[-1]

    def _count(self, server_round: int, **amounts: int) -> None:
        entry = self._round_entry(server_round)
        for k, v in amounts.items():
            entry[k] += v
            if k in self.traffic:
                self.traffic[k] += v

    # -- downstream --------------------------------------------------------------------------------

    def _sample(self, grid: Grid, server_round: int, fraction: float, minimum: int) -> list[int]:
        if self.sample_fn is not None:
            _, nodes = sample_nodes(grid, self.min_available_nodes, 0)
            return [int(n) for n in self.sample_fn(server_round, sorted(nodes))]
        size = max(int(len(list(grid.get_node_ids())) * fraction), minimum)
        chosen, _ = sample_nodes(grid, self.min_available_nodes, size)
        return sorted(chosen)

    def _message(self, node: int, config: ConfigRecord, message_type: str, server_round: int) -> Message:
        server = self._fed
        cid = self._client_id(node)
        known = self._node_round.get(node)
        if known is None and not self.clients_hold_initial:
            snap = server.down_session.snapshot() if server.down_session is not None else b""
            catch = CatchUp([], server.model, snap, round=server.round)
        else:
            catch = server.catch_up(known if known is not None else 0)
        up = server.up_sessions.get(cid)
        cfg: dict[str, Any] = {
            "client-id": cid, "round": server.round, "model-hash": self._model_hash(),
            "density": self.density, "method": self.method, "coder": self.coder, "feedback": self.feedback,
            "arrays-key": self.arrayrecord_key, "up-seq": up.seq if up is not None else 0,
        }
        records: dict[str, Any] = {self.configrecord_key: config}
        if catch.full_model is not None:
            cfg["model"] = _pack({k: server.model[k] for k in self._order})
            cfg["snapshot"] = catch.session_snapshot or b""
        elif catch.messages:  # (Flower cannot serialise an empty list)
            cfg["messages"] = list(catch.messages)
        records[KEY] = ConfigRecord(cfg)
        msg = Message(RecordDict(records), dst_node_id=node, message_type=message_type)
        self._count(server_round, down=catch.nbytes, full_downloads=int(catch.full_model is not None),
                    wire_down=_wire_size(msg) if self.measure_wire else 0)
        return msg

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample the training nodes and send each the downstream it needs (not the model)."""
        self._ensure_server(arrays)
        if self.fraction_train == 0.0 and self.sample_fn is None:
            return []
        nodes = self._sample(grid, server_round, self.fraction_train, self.min_train_nodes)
        _log.info("configure_train: %d nodes, global model at round %d", len(nodes), self._fed.round)
        config["server-round"] = server_round
        return [self._message(n, config, MessageType.TRAIN, server_round) for n in nodes]

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation with the same compressed downstream."""
        self._ensure_server(arrays)
        if self.fraction_evaluate == 0.0:
            return []
        size = max(int(len(list(grid.get_node_ids())) * self.fraction_evaluate), self.min_evaluate_nodes)
        nodes, _ = sample_nodes(grid, self.min_available_nodes, size)
        config["server-round"] = server_round
        return [self._message(n, config, MessageType.EVALUATE, server_round) for n in sorted(nodes)]

    # -- upstream ----------------------------------------------------------------------------------

    def _note_round(self, msg: Message) -> None:
        cfg = msg.content.config_records.get(KEY)
        if cfg is not None and "round" in cfg:
            self._node_round[msg.metadata.src_node_id] = _field(cfg, "round", int)

    def _receive(self, cid: int, data: bytes) -> None:
        header = read_update_header(data)
        session = self._fed.up_sessions.get(cid)
        if session is not None and header.session_id and header.session_seq == 0 and session.seq != 0:
            # the client restarted its stream after a lost message (see _sync): so do we
            self._fed.up_sessions[cid] = UpdateSession(session.session_id)
        self._fed.receive(cid, data)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode every update against the global model, average, re-sparsify, move one round on."""
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        entries = []
        for msg in valid:
            node = msg.metadata.src_node_id
            self._note_round(msg)  # the round the client synchronised to, even if its update is refused
            cfg = msg.content.config_records.get(KEY)
            if cfg is None or "update" not in cfg:
                _log.warning("aggregate_train: node %d replied without a deepcabac update (is deepcabac_mod among "
                             "its ClientApp's mods?)", node)
                continue
            data = _field(cfg, "update", bytes)
            self._count(server_round, up=len(data), wire_up=_wire_size(msg) if self.measure_wire else 0)
            entries.append((self._client_id(node), node, data, msg))
        # The mean is summed in client order: the same clients give the same bits whatever order
        # their replies arrived in.
        entries.sort(key=lambda e: e[0])
        accepted = []
        for cid, node, data, msg in entries:
            try:
                self._receive(cid, data)
            except DeepCabacError as exc:
                _log.warning("aggregate_train: update of node %d (client %d) refused: %s", node, cid, exc)
                continue
            accepted.append(msg.content)
        self._count(server_round, clients=len(accepted))
        if not accepted:
            return None, None
        self._fed.aggregate()
        metrics = self._train_metrics(accepted)
        entry = self._round_entry(server_round)
        metrics["deepcabac-up-bytes"] = entry["up"]
        metrics["deepcabac-down-bytes"] = entry["down"]
        return self.global_arrays(), metrics

    def _train_metrics(self, contents: list[RecordDict]) -> MetricRecord:
        from flwr.serverapp.exception import InconsistentMessageReplies
        from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

        try:
            validate_message_reply_consistency(contents, self.weighted_by_key, check_arrayrecord=False)
        except InconsistentMessageReplies as exc:
            _log.warning("aggregate_train: client metrics not aggregated: %s", exc)
            return MetricRecord()
        return self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """FedAvg's metric aggregation; notes which round each replying client is now at."""
        replies = list(replies)
        for msg in replies:
            if not msg.has_error():
                self._note_round(msg)
        return super().aggregate_evaluate(server_round, replies)


def _wire_size(msg: Message) -> int:
    """Bytes of ``msg`` as Flower serialises it (every object of its tree, headers included)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())
