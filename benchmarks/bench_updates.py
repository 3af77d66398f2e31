"""Bits per nonzero of sparse update streams: our context-adaptive coder against the Golomb code.

One client trains the small CNN of ``fl_common`` on MNIST-5k (4,000 training images) for ROUNDS
rounds of LOCAL_STEPS SGD steps each (communication delay). Every round's update (new local model
minus the parent, the model both ends hold) goes through error feedback and STC at the density,
is coded against its parent in a session (our coder, contexts carried over from earlier rounds)
and, for the same levels, with the Golomb position code + one sign bit per nonzero. Both carry the
same levels, so the reconstruction is equal by construction. Payload bits are compared (the message
header, the same for both, is reported separately).

Printed: per density the mean bits per nonzero over the rounds, the ratio, the first round alone
against the empirical entropy of its positions, and an ablation of our context families.

    .venv/bin/python benchmarks/bench_updates.py [--rounds 30] [--json benchmarks/out/bench_updates.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fl_common as fc  # noqa: E402

from deepcabac_py.updates import _update_kernels as K  # noqa: E402
from deepcabac_py.updates import golomb  # noqa: E402
from deepcabac_py.updates.message_format import read_update_header  # noqa: E402
from deepcabac_py.updates.messages import encode_sparse  # noqa: E402
from deepcabac_py.updates.sessions import UpdateSession  # noqa: E402
from deepcabac_py.updates.sparsify import ErrorFeedback, stc  # noqa: E402

DENSITIES = (0.1, 0.01, 0.001)
LOCAL_STEPS = 10
BATCH = 32
LR = 0.05

V1 = K.F_ALL_V1  # the context families of update format 1
ABLATION = [
    ("none (adaptive sig/sign only)", 0),
    ("+ row skip", K.F_ROWSKIP),
    ("+ row activity", K.F_ROWSKIP | K.F_ROW),
    ("+ column activity", K.F_ROWSKIP | K.F_ROW | K.F_COLUMN),
    ("+ temporal (parent level)", K.F_ROWSKIP | K.F_ROW | K.F_COLUMN | K.F_TEMPORAL),
    ("+ history (age, count, last sign)", K.F_ROWSKIP | K.F_ROW | K.F_COLUMN | K.F_TEMPORAL | K.F_HISTORY),
    ("+ area (row/col history)", V1 & ~K.F_SIGNCTX),
    ("+ sign contexts (= format 1)", V1),
    ("format 1 but row skip", V1 & ~K.F_ROWSKIP),
    ("+ mixing (= all)", K.F_ALL),
    ("all but row skip (default)", K.F_ALL & ~K.F_ROWSKIP),
    ("default but temporal", K.F_ALL & ~K.F_ROWSKIP & ~K.F_TEMPORAL),
    ("default but history+area", K.F_ALL & ~K.F_ROWSKIP & ~K.F_HISTORY & ~K.F_AREA),
    ("default but column", K.F_ALL & ~K.F_ROWSKIP & ~K.F_COLUMN),
    ("default but row activity", K.F_ALL & ~K.F_ROWSKIP & ~K.F_ROW),
    ("default but sign contexts", K.F_ALL & ~K.F_ROWSKIP & ~K.F_SIGNCTX),
]


def make_stream(density: float, rounds: int, seed: int = 0):
    """The rounds of one client: (parent state, {name: SparseTensor}) per round, plus accuracies."""
    (Xtr, ytr), (Xte, yte) = fc.load_mnist5k(seed)
    model = fc.make_model(seed)
    gen = torch.Generator().manual_seed(seed)
    server = fc.state_numpy(model)
    ef = ErrorFeedback()
    stream = []
    for _ in range(rounds):
        fc.load_state(model, server)
        fc.local_train(model, Xtr, ytr, steps=LOCAL_STEPS, batch=BATCH, lr=LR, gen=gen)
        local = fc.state_numpy(model)
        delta = {k: local[k].astype(np.float64) - server[k] for k in server}
        sent = ef.step(delta, lambda name, a: stc(a, density, sampled=False))
        stream.append(({k: v.copy() for k, v in server.items()}, sent))
        server = {k: (server[k] + sent[k].values()).astype(np.float32) for k in server}
    fc.load_state(model, server)
    return stream, fc.accuracy(model, Xte, yte)


def code_stream(stream, *, coder: str, features: int | None = None, session_id: int = 1):
    """Payload bits per round (and header bytes per round) for one coder configuration."""
    session = UpdateSession(session_id) if coder == "cabac" else None
    bits, heads = [], []
    for r, (parent, sent) in enumerate(stream):
        data = encode_sparse(sent, parent, round_index=r + 1, parent_round=r, session=session, coder=coder,
                             features=features, table=False)
        h = read_update_header(data)
        bits.append(8 * h.payload_size)
        heads.append(h.header_size + 4)
    return np.array(bits), np.array(heads)


def position_only_bits(sent, parent, features) -> int:
    """Our coder on the positions alone (signs made positive, sent as SBC-like one-sided levels)."""
    from deepcabac_py.updates.sparsify import SparseTensor

    pos = {n: SparseTensor(np.abs(s.levels), s.step if s.step > 0 else 1.0, "sbc") for n, s in sent.items() if s.nnz}
    data = encode_sparse(pos, parent, session=UpdateSession(99), features=features, table=False)
    return 8 * read_update_header(data).payload_size


def entropy_bound(sent) -> tuple[float, float]:
    """(log2 C(n, k) summed over tensors, empirical sign entropy in bits) of one round."""
    pos_bits, neg, k_all = 0.0, 0, 0
    for s in sent.values():
        n, k = s.levels.size, s.nnz
        pos_bits += (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        neg += int((s.levels < 0).sum())
        k_all += k
    p = neg / k_all
    h_sign = 0.0 if p in (0, 1) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return pos_bits, h_sign * k_all


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--densities", type=float, nargs="*", default=list(DENSITIES))
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "bench_updates.json"))
    ap.add_argument("--no-ablation", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    results = {}
    table = []
    for p in args.densities:
        stream, acc = make_stream(p, args.rounds)
        nnz = np.array([sum(s.nnz for s in sent.values()) for _, sent in stream])
        gb, gh = code_stream(stream, coder="golomb")
        ob, oh = code_stream(stream, coder="cabac")
        formula = np.array([sum(golomb.stc_bits(s.levels, step_bits=0) for s in sent.values()) for _, sent in stream])
        assert np.all(formula <= gb) and np.all(gb - formula < 8), "Golomb payload differs from the closed form"
        g_bpn, o_bpn = (gb / nnz).mean(), (ob / nnz).mean()
        parent0, sent0 = stream[0]
        ent_pos, ent_sign = entropy_bound(sent0)
        pos_g = sum(golomb.position_bits(np.flatnonzero(s.levels), s.levels.size) for s in sent0.values())
        pos_o = position_only_bits(sent0, parent0, None)
        row = dict(density=p, rounds=args.rounds, accuracy=acc, nnz_per_round=float(nnz.mean()),
                   golomb_bpn=float(g_bpn), ours_bpn=float(o_bpn), ratio=float(o_bpn / g_bpn),
                   ratio_total_bits=float(ob.sum() / gb.sum()), header_bytes=float(oh.mean()),
                   first=dict(entropy_pos_bpn=ent_pos / nnz[0], entropy_sign_bpn=ent_sign / nnz[0],
                              golomb_pos_bpn=pos_g / nnz[0], ours_pos_bpn=pos_o / nnz[0],
                              golomb_bpn=gb[0] / nnz[0], ours_bpn=ob[0] / nnz[0]),
                   per_round=dict(golomb=(gb / nnz).round(3).tolist(), ours=(ob / nnz).round(3).tolist()))
        if not args.no_ablation:
            row["ablation"] = {}
            for label, f in ABLATION:
                b, _ = code_stream(stream, coder="cabac", features=f)
                row["ablation"][label] = float((b / nnz).mean())
        results[str(p)] = row
        table.append(row)
        print(f"density {p}: done ({time.time() - t0:.0f} s)", file=sys.stderr)

    print(f"\nUpdate streams: one client, small CNN (80k params) on MNIST-5k, {args.rounds} rounds x {LOCAL_STEPS} "
          f"local SGD steps, STC + error feedback; bits per nonzero of the payload (positions + signs), "
          "averaged over rounds. Equal levels => equal reconstruction.\n")
    print(f"{'density':>8} {'nnz/round':>10} {'Golomb':>8} {'ours':>8} {'ours/Golomb':>12} {'target<=0.70':>13} "
          f"{'hdr B/msg':>10} {'final acc':>10}")
    for row in table:
        ok = "yes" if row["ratio"] <= 0.70 else "NO"
        print(f"{row['density']:>8} {row['nnz_per_round']:>10.0f} {row['golomb_bpn']:>8.3f} {row['ours_bpn']:>8.3f} "
              f"{row['ratio']:>12.3f} {ok:>13} {row['header_bytes']:>10.0f} {row['accuracy']:>10.3f}")
    print("\nFirst round alone (no history): bits per nonzero; 'entropy' = log2 C(n, k) per tensor (positions, "
          "uniform k-subset) and the empirical sign entropy.")
    print(f"{'density':>8} {'pos entropy':>12} {'Golomb pos':>11} {'ours pos':>9} {'sign entropy':>13} "
          f"{'Golomb total':>13} {'ours total':>11} {'ours/Golomb':>12}")
    for row in table:
        f = row["first"]
        print(f"{row['density']:>8} {f['entropy_pos_bpn']:>12.3f} {f['golomb_pos_bpn']:>11.3f} {f['ours_pos_bpn']:>9.3f} "
              f"{f['entropy_sign_bpn']:>13.3f} {f['golomb_bpn']:>13.3f} {f['ours_bpn']:>11.3f} "
              f"{f['ours_bpn'] / f['golomb_bpn']:>12.3f}")
    if not args.no_ablation:
        print("\nAblation: our bits per nonzero (mean over rounds) with context families switched on one by one")
        print(f"{'contexts':<34}" + "".join(f"{'p=' + str(r['density']):>10}" for r in table))
        for label, _ in ABLATION:
            print(f"{label:<34}" + "".join(f"{r['ablation'][label]:>10.3f}" for r in table))
        print(f"{'Golomb + 1 sign bit':<34}" + "".join(f"{r['golomb_bpn']:>10.3f}" for r in table))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{time.time() - t0:.0f} s; JSON in {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
