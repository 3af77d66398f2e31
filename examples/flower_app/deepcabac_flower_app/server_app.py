"""ServerApp: ``DeepCabacStrategy`` (FedAvg's sampling, sparse update streams both ways) and a
server-side evaluation on a held-out shard before the first round and after every round."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from deepcabac_py.integrations.flower import DeepCabacStrategy

from .task import TEST_SEED, accuracy, make_net, shard

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    x, y = shard(TEST_SEED)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = make_net()
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, x, y)})

    nodes = int(cfg["min-available-nodes"])  # the federation's size: wait for all before the first round
    strategy = DeepCabacStrategy(density=float(cfg["density"]), fraction_train=float(cfg["fraction-train"]),
                                 fraction_evaluate=0.0, min_available_nodes=nodes)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net().state_dict()), num_rounds=rounds,
                            evaluate_fn=evaluate)
    metrics = result.evaluate_metrics_serverapp
    print(f"accuracy {metrics[0]['accuracy']:.4f} -> {metrics[rounds]['accuracy']:.4f} "
          f"after {rounds} rounds, bytes up {strategy.traffic['up']} down {strategy.traffic['down']}", flush=True)
