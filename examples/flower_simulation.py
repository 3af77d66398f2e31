"""Federated training through Flower's simulation engine, with deepcabac update messages.

    .venv/bin/pip install -e '.[flower]' && .venv/bin/python examples/flower_simulation.py [--rounds 10]

``deepcabac_mod`` is a client-side Mod: the ``ClientApp``'s train function below is exactly what it
would be for FedAvg (it gets the global model as an ``ArrayRecord`` and replies with the trained
one), and the Mod turns the reply into one update message. ``DeepCabacStrategy`` is a FedAvg whose
transport and aggregation are ``FedServer``'s. For the same app under ``flwr run``, see
``examples/flower_app/``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from deepcabac_py.integrations.flower import DeepCabacStrategy, deepcabac_mod


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def shard(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A small synthetic task: which side of a hyperplane."""
    x = np.random.default_rng(seed).normal(size=(256, 20)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy((x[:, 0] + x[:, 1] > 0).astype(np.int64))


client = ClientApp(mods=[deepcabac_mod])  # the train function below is the same as for FedAvg


@client.train()
def train(msg: Message, context: Context) -> Message:
    net = make_net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = shard(int(context.node_config["partition-id"]))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)


def make_server(rounds: int, clients: int) -> ServerApp:
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        x, y = shard(99)

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            net = make_net()
            net.load_state_dict(arrays.to_torch_state_dict())
            return MetricRecord({"accuracy": float((net(x).argmax(1) == y).float().mean())})

        strategy = DeepCabacStrategy(density=0.05, fraction_train=0.5, fraction_evaluate=0.0,
                                     min_available_nodes=clients)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=rounds,
                                evaluate_fn=evaluate)
        acc = result.evaluate_metrics_serverapp
        print(f"accuracy {acc[0]['accuracy']:.3f} -> {acc[rounds]['accuracy']:.3f}; "
              f"bytes up {strategy.traffic['up']:,}, down {strategy.traffic['down']:,}")

    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    run_simulation(server_app=make_server(args.rounds, args.clients), client_app=client,
                   num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})


if __name__ == "__main__":
    main()
