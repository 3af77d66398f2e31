"""Sparse gradients between the ranks of PyTorch DDP, through the deepcabac communication hook.

    .venv/bin/torchrun --nproc-per-node 2 examples/ddp_hook.py [--steps 300] [--dtype bfloat16]

Each rank trains the same small MLP on its own batches of a shared teacher task; after two dense
warm-up steps, every gradient bucket goes out as sparse ternary levels coded by our arithmetic coder.
The last line of each rank says what it handed to the collectives, against a dense all-reduce in
float32 and in the gradients' own dtype.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from deepcabac_py.integrations.ddp import DeepCabacState, deepcabac_hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the model's (and so the gradients') dtype")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same start and the same teacher on every rank
    teacher = torch.randn(64, 10)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(dtype)
    model = nn.parallel.DistributedDataParallel(net)
    state = DeepCabacState(density=0.02, method="stc", coder="cabac", warmup_steps=2)
    model.register_comm_hook(state, deepcabac_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own batches
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=gen)
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    s = state.stats()
    print(f"rank {dist.get_rank()}: loss {loss.item():.3f}, {s['bytes_per_step']:.0f} bytes/step handed to the "
          f"collectives, {s['ratio']:.0f}x less than a dense fp32 all-reduce, {s['ratio_vs_dense']:.0f}x less than "
          f"dense {args.dtype}")
    state.close()  # (the hook's last exchanges go while the process group is still there)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
