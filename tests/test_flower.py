"""Flower integration (deepcabac_py.integrations.flower): the Mod and the strategy.

Most tests drive the real ``DeepCabacStrategy.start`` loop and the real ``ClientApp`` (with the
mod) in this process through a small stand-in for Flower's Grid that carries every message and
every client context through Flower's own protobuf serialisation, as a SuperLink and SuperNodes
do; it can also lose replies. The last test is a real run of Flower's simulation engine.

Every run is compared with the same rounds played directly on ``FedServer``/``FedClient``: the
same bytes must travel and the same global model must come out.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

pytest.importorskip("flwr")
torch = pytest.importorskip("torch")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto  # noqa: E402
from flwr.proto.message_pb2 import Message as ProtoMessage  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from deepcabac_py import decode_checkpoint  # noqa: E402
from deepcabac_py.integrations.flower import STATE, DeepCabacStrategy, deepcabac_mod, make_deepcabac_mod  # noqa: E402
from deepcabac_py.updates.federated import CatchUp, FedClient, FedServer, crc_of_model  # noqa: E402
from deepcabac_py.updates.parent_model import model_hash  # noqa: E402

CLIENTS = 4
DENSITY = 0.05
LOCAL_STEPS = 5


# --------------------------------------------------------------------------------------------------
# the task: 4 clients of two classes each (non-iid) on synthetic 16-d blobs, an MLP with a counter
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _data():
    g = np.random.default_rng(0)
    centers = g.normal(0.0, 1.0, size=(4, 16))
    y = g.integers(0, 4, size=1600)
    X = (centers[y] + g.normal(0.0, 1.0, size=(1600, 16))).astype(np.float32)
    test = slice(0, 400)
    shards = [np.flatnonzero(np.isin(y[400:], [c, (c + 1) % 4])) + 400 for c in range(CLIENTS)]
    return X, y, test, shards


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 128)
        self.fc2 = torch.nn.Linear(128, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))  # integer tensors travel exactly

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _initial() -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return {k: v.numpy().copy() for k, v in Net().state_dict().items()}


def _net(state) -> Net:
    net = Net()
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
    return net


def _local_train(state, partition: int, server_round: int, count_steps: bool = True) -> dict[str, np.ndarray]:
    X, y, _, shards = _data()
    net = _net(state)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 * server_round + partition)
    idx = torch.from_numpy(shards[partition])
    Xs, ys = torch.from_numpy(X)[idx], torch.from_numpy(y)[idx]
    for _ in range(LOCAL_STEPS):
        b = torch.randint(0, len(ys), (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(Xs[b]), ys[b]).backward()
        opt.step()
    if count_steps:
        net.steps += LOCAL_STEPS
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _accuracy(state) -> float:
    X, y, test, _ = _data()
    with torch.no_grad():
        return float((_net(state)(torch.from_numpy(X[test])).argmax(1).numpy() == y[test]).mean())


def _numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


def _client_app(mod, count_steps: bool = True) -> ClientApp:
    app = ClientApp(mods=[mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        local = _local_train(_numpy(msg.content["arrays"]), pid, int(msg.content["config"]["server-round"]),
                             count_steps)
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in local.items()}),
                                   "metrics": MetricRecord({"num-examples": 100})}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        acc = _accuracy(_numpy(msg.content["arrays"]))
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": acc, "num-examples": 400})}), reply_to=msg)

    @app.query("partition")
    def partition(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"node": MetricRecord({"partition-id": pid})}), reply_to=msg)

    return app


client_app = _client_app(deepcabac_mod)
client_app_holding_initial = _client_app(make_deepcabac_mod(initial=_initial))


def _schedule(server_round: int) -> list[int]:
    """Three of four clients a round, a different one resting each time: catch-ups of 0, 1, 2 rounds."""
    return sorted(c for c in range(CLIENTS) if c != (server_round * 3) % CLIENTS)


# --------------------------------------------------------------------------------------------------
# the same rounds on FedServer / FedClient
# --------------------------------------------------------------------------------------------------


def _reference(rounds: int, hold_initial: bool, schedule=_schedule, server_lr: float = 1.0):
    init = _initial()
    server = FedServer(init, density=DENSITY, server_lr=server_lr)
    clients: dict[int, FedClient] = {}
    up = down = 0
    hashes = [model_hash(init)]  # the global model of every round
    for r in range(1, rounds + 1):
        for c in schedule(r):
            if c in clients:
                catch = server.catch_up(clients[c].round)
            elif hold_initial:
                clients[c] = FedClient(c, init, density=DENSITY)
                catch = server.catch_up(0)
            else:
                clients[c] = FedClient(c, init, density=DENSITY)
                catch = CatchUp([], server.model, server.down_session.snapshot(), round=server.round)
            clients[c].sync(catch)
            down += catch.nbytes
            msg = clients[c].upstream(_local_train(clients[c].model, c, r))
            up += len(msg)
            server.receive(c, msg)
        server.aggregate()
        hashes.append(model_hash(server.model))
    return server, up, down, hashes


# --------------------------------------------------------------------------------------------------
# an in-process Grid: Flower's serialisation on every hop, optional lost replies
# --------------------------------------------------------------------------------------------------


def _over_the_wire(msg: Message) -> Message:
    proto = ProtoMessage()
    proto.ParseFromString(message_to_proto(msg).SerializeToString())
    return message_from_proto(proto)


class LocalGrid:
    """What ``Strategy.start`` needs of a Grid, with nodes that run a ClientApp in this process."""

    def __init__(self, app: ClientApp, nodes: int = CLIENTS, lose=()):
        self.app = app
        self.node_ids = [1000 + 17 * i for i in range(nodes)]  # not 0..n-1: ids are not partitions
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i}, state=RecordDict(),
                                    run_config={}) for i, n in enumerate(self.node_ids)}
        self.lose = set(lose)  # (server round, partition): the node runs, its reply never arrives
        self.errors: list[str] = []

    def get_node_ids(self):
        return list(self.node_ids)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            msg = _over_the_wire(msg)
            ctx = self.contexts[node]
            try:
                reply = self.app(msg, ctx)
            except Exception as exc:  # a SuperNode turns a failing ClientApp into an error reply
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
                self.errors.append(reply.error.reason)
            # the context goes back to the SuperNode serialised, as from an isolated ClientApp
            self.contexts[node] = context_from_proto(context_to_proto(ctx))
            key = (int(msg.content["config"].get("server-round", 0)), int(ctx.node_config["partition-id"]))
            if key not in self.lose:
                replies.append(_over_the_wire(reply))
        return replies

    def client_state(self, partition: int) -> ConfigRecord:
        return self.contexts[self.node_ids[partition]].state.config_records[STATE]

    def client_model(self, partition: int) -> dict[str, np.ndarray]:
        return dict(decode_checkpoint(self.client_state(partition)["model"]).tensors)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The networks here are tiny: torch's threads would only spin against each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def task_identity():
    """Messages made outside a Flower run need the identity a SuperLink would give them."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _strategy(grid: LocalGrid, **kwargs) -> DeepCabacStrategy:
    by_partition = dict(enumerate(grid.node_ids))
    defaults = dict(density=DENSITY, fraction_evaluate=0.0, min_available_nodes=CLIENTS,
                    client_ids={n: i for i, n in by_partition.items()},
                    sample_fn=lambda r, nodes: [by_partition[c] for c in _schedule(r)])
    return DeepCabacStrategy(**{**defaults, **kwargs})


def _initial_arrays() -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in _initial().items()})


# --------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hold_initial,server_lr", [(False, 1.0), (True, 1.0), (False, 2.0)],
                         ids=["full-first-download", "clients-hold-initial", "server-lr-2"])
def test_rounds_through_flower_messages_match_fedserver_exactly(task_identity, hold_initial, server_lr):
    rounds = 6
    grid = LocalGrid(client_app_holding_initial if hold_initial else client_app)
    strategy = _strategy(grid, clients_hold_initial=hold_initial, measure_wire=True, server_lr=server_lr)
    result = strategy.start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=rounds)
    assert not grid.errors
    ref, up, down, hashes = _reference(rounds, hold_initial, server_lr=server_lr)
    assert crc_of_model(_numpy(result.arrays)) == crc_of_model(ref.model)
    assert list(result.arrays.keys()) == list(_initial())  # the user's key order, not sorted
    assert strategy.traffic["up"] == up and strategy.traffic["down"] == down
    assert strategy.traffic["full_downloads"] == (0 if hold_initial else CLIENTS)
    assert [r["clients"] for r in strategy.rounds] == [3] * rounds
    # what Flower really serialises: the update bytes plus a bounded framing, far below fp32
    dense = sum(v.nbytes for v in _initial().values())
    assert up < strategy.traffic["wire_up"] < up + 3 * rounds * 1500
    assert strategy.traffic["wire_up"] < 0.1 * 3 * rounds * dense
    # every client holds, bit for bit, the global model of the round it last trained from
    for c in range(CLIENTS):
        seen = int(grid.client_state(c)["round"])
        assert seen == max(r for r in range(1, rounds + 1) if c in _schedule(r)) - 1
        assert model_hash(grid.client_model(c)) == hashes[seen]
    assert _accuracy(_numpy(result.arrays)) > _accuracy(_initial()) + 0.2
    assert result.train_metrics_clientapp[1]["deepcabac-up-bytes"] == strategy.rounds[0]["up"]


def test_federated_evaluation_receives_the_compressed_downstream(task_identity):
    grid = LocalGrid(client_app)
    strategy = _strategy(grid, fraction_evaluate=1.0, min_evaluate_nodes=CLIENTS)
    result = strategy.start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=3)
    assert not grid.errors
    global_hash = model_hash(_numpy(result.arrays))
    for c in range(CLIENTS):  # evaluating brought every client to the newest global model
        assert int(grid.client_state(c)["round"]) == 3
        assert model_hash(grid.client_model(c)) == global_hash
    assert result.evaluate_metrics_clientapp[3]["accuracy"] > _accuracy(_initial()) + 0.2
    # after evaluating round 1's model nobody needs anything to train in round 2; evaluating
    # round 2 then costs every client exactly round 2's message
    assert strategy.rounds[1]["full_downloads"] == 0
    assert strategy.rounds[1]["down"] == CLIENTS * len(strategy.server.messages[2])


def test_a_lost_reply_is_recovered_without_resending_the_model(task_identity):
    rounds = 7
    lost = (2, _schedule(2)[0])  # that client trains and codes, the server never hears of it
    grid = LocalGrid(client_app, lose={lost})
    strategy = _strategy(grid)
    result = strategy.start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=rounds)
    assert not grid.errors
    assert [r["clients"] for r in strategy.rounds] == [3, 2] + [3] * (rounds - 2)
    assert strategy.traffic["full_downloads"] == CLIENTS  # first contacts only
    # the client's upstream stream restarted: the server decoded every later update
    assert int(grid.client_state(lost[1])["round"]) >= rounds - 3
    assert _accuracy(_numpy(result.arrays)) > _accuracy(_initial()) + 0.2


def test_clients_holding_another_initial_model_are_refused(task_identity):
    other = _client_app(make_deepcabac_mod(initial=lambda: {k: np.asarray(v + 1) for k, v in _initial().items()}))
    grid = LocalGrid(other)
    strategy = _strategy(grid, clients_hold_initial=True)
    strategy.start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=2)
    assert len(grid.errors) == 6 and all("differs from the server's" in e for e in grid.errors)
    assert [r["clients"] for r in strategy.rounds] == [0, 0]
    grid = LocalGrid(client_app)  # no initial model at all
    _strategy(grid, clients_hold_initial=True).start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=1)
    assert grid.errors and "make_deepcabac_mod(initial=...)" in grid.errors[0]


def test_messages_of_other_strategies_pass_through_the_mod(task_identity):
    grid = LocalGrid(client_app)
    result = FedAvg(fraction_evaluate=0.0, min_available_nodes=CLIENTS).start(
        grid=grid, initial_arrays=_initial_arrays(), num_rounds=2)
    assert not grid.errors and set(result.arrays.keys()) == set(_initial())
    assert all(STATE not in ctx.state.config_records for ctx in grid.contexts.values())


def test_the_golomb_baseline_runs_through_the_same_path(task_identity):
    grid = LocalGrid(client_app)  # the step counter moves by 5: not a ternary level
    _strategy(grid, coder="golomb").start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=1)
    assert len(grid.errors) == 3 and "levels in {-1, 0, 1} only" in grid.errors[0]
    costs = {}
    for coder in ("golomb", "cabac"):
        grid = LocalGrid(_client_app(deepcabac_mod, count_steps=False))
        strategy = _strategy(grid, coder=coder)
        result = strategy.start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=4)
        assert not grid.errors and [r["clients"] for r in strategy.rounds] == [3] * 4
        assert _accuracy(_numpy(result.arrays)) > _accuracy(_initial()) + 0.2
        costs[coder] = strategy.traffic["up"]
    assert costs["cabac"] < costs["golomb"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DeepCabacStrategy(density=0.0)
    with pytest.raises(ValueError):
        DeepCabacStrategy(method="dense")
    with pytest.raises(ValueError):
        DeepCabacStrategy(coder="golomb", method="topk")
    with pytest.raises(ValueError):
        DeepCabacStrategy(client_ids={1: 0, 2: 0})
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="server_lr"):
            DeepCabacStrategy(server_lr=bad)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # Ray's notice about accelerator variables
def test_flower_simulation_engine():
    """A real Flower run: the simulation engine, ClientApps in Ray actors, messages through its
    LinkState. Small: 4 supernodes, 6 rounds, about 15 s on 2 cores."""
    pytest.importorskip("ray")
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    rounds, out = 6, {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(nodes := sorted(grid.get_node_ids())) < CLIENTS:
            time.sleep(0.05)
        asks = [Message(RecordDict(), dst_node_id=n, message_type="query.partition") for n in nodes]
        pid = {r.metadata.src_node_id: int(r.content["node"]["partition-id"]) for r in grid.send_and_receive(asks)}
        node = {p: n for n, p in pid.items()}
        strategy = DeepCabacStrategy(density=DENSITY, fraction_evaluate=0.0, min_available_nodes=CLIENTS,
                                     client_ids=pid, sample_fn=lambda r, _: [node[c] for c in _schedule(r)],
                                     measure_wire=True)
        accs = {}

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            accs[server_round] = _accuracy(_numpy(arrays))
            return MetricRecord({"accuracy": accs[server_round]})

        result = strategy.start(grid=grid, initial_arrays=_initial_arrays(), num_rounds=rounds, evaluate_fn=evaluate)
        out.update(arrays=_numpy(result.arrays), traffic=dict(strategy.traffic), rounds=strategy.rounds, accs=accs)

    run_simulation(server_app=app, client_app=client_app, num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}})
    assert out, "the ServerApp did not finish"
    assert [r["clients"] for r in out["rounds"]] == [3] * rounds
    ref, up, down, _ = _reference(rounds, hold_initial=False)
    assert crc_of_model(out["arrays"]) == crc_of_model(ref.model)
    assert out["traffic"]["up"] == up and out["traffic"]["down"] == down
    assert out["traffic"]["wire_up"] < 0.1 * 3 * rounds * sum(v.nbytes for v in _initial().values())
    assert out["accs"][rounds] > out["accs"][0] + 0.2
