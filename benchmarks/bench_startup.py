"""Start-up of the command line, as a user meets it: the first encode of the demo model with an empty
Numba cache (every kernel it needs compiled), the first lossless encode and the first decode of its
stream (an empty cache again), then warm `encode`, `decode` and `info` of the same small
.safetensors file, each command in a process of its own. Beside them: what importing numba and
click (every command) and torch (what a safetensors round trip no longer needs) cost alone; with
--vs REF, the same commands of another commit (a temporary git worktree) in the same run, and the
ratio.

    .venv/bin/python benchmarks/bench_startup.py [--repeats 7] [--cold-repeats 3] [--lossless-repeats 1]
        [--vs 3eefbcb]

Goals (the CLI issue): first encode <= 15 s, warm encode and decode <= 1.0 s each, no torch import
for a safetensors round trip. Medians of the repeats (this machine is noisy).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "digits_cnn.safetensors"

# The CLI in-process, reporting whether it imported torch.
WATCH = """
import json, sys
from deepcabac_py.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps("torch" in sys.modules), file=sys.stderr)
"""


def wall(cmd: list[str], env: dict, cwd: Path | None = None) -> float:
    # (cwd: `python -m` puts the working directory first on sys.path, so it must not hold another tree)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return t


class Checkout:
    """The CLI of one source tree (this one, or a commit in a temporary worktree)."""

    def __init__(self, label: str, root: Path, work: Path):
        self.label, self.root, self.work = label, root, work
        self.env = {**os.environ, "PYTHONPATH": str(root)}
        self.cli = [sys.executable, "-m", "deepcabac_py.cli.main"]
        self.work.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEMO, self.work / "m.safetensors")

    def cold(self, commands: list[list[str]], repeats: int) -> list[list[float]]:
        """Wall times of ``commands`` run in turn, each repeat in an empty Numba cache of its own (a
        later command compiles what the earlier ones did not): one list per command."""
        times: list[list[float]] = [[] for _ in commands]
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cache:
                env = {**self.env, "NUMBA_CACHE_DIR": cache}
                for row, args in zip(times, commands):
                    row.append(wall(self.cli + args, env, self.work))
        return times

    def warm(self, repeats: int) -> dict[str, list[float]]:
        env = {**self.env, "NUMBA_CACHE_DIR": str(self.work / "numba")}
        src, dcb, back = (str(self.work / n) for n in ("m.safetensors", "m.dcb", "back.safetensors"))
        commands = {"encode": ["encode", src, "-o", dcb, "-q", "-f"],
                    "decode": ["decode", dcb, "-o", back, "-q", "-f"],
                    "info": ["info", dcb]}
        for args in commands.values():  # compile into this checkout's cache first
            wall(self.cli + args, env, self.work)
        times: dict[str, list[float]] = {k: [] for k in commands}
        for _ in range(repeats):  # interleaved, so that a noisy moment hits every command alike
            for name, args in commands.items():
                times[name].append(wall(self.cli + args, env, self.work))
        return times

    def imports_torch(self) -> dict[str, bool]:
        env = {**self.env, "NUMBA_CACHE_DIR": str(self.work / "numba")}
        src, dcb, back = (str(self.work / n) for n in ("m.safetensors", "m.dcb", "back.safetensors"))
        out = {}
        for name, args in {"encode": ["encode", src, "-o", dcb, "-q", "-f"],
                           "decode": ["decode", dcb, "-o", back, "-q", "-f"]}.items():
            r = subprocess.run([sys.executable, "-c", WATCH, *args], env=env, cwd=self.work, capture_output=True,
                               text=True)
            out[name] = json.loads(r.stderr.strip().splitlines()[-1])
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="warm runs of each command")
    ap.add_argument("--cold-repeats", type=int, default=3, help="first encodes, each with an empty cache")
    ap.add_argument("--lossless-repeats", type=int, default=1,
                    help="first lossless encodes and decodes, each pair with an empty cache (about a minute each)")
    ap.add_argument("--vs", default=None, help="a git commit to run side by side")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    checkouts = [Checkout("this tree", ROOT, base / "this")]
    worktree = None
    if args.vs:
        worktree = base / "ref-tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), args.vs],
                       check=True)
        checkouts.append(Checkout(args.vs, worktree, base / "ref"))
    try:
        env = dict(os.environ)
        floor = statistics.median(wall([sys.executable, "-c", "import click, numba"], env, base)
                                  for _ in range(args.repeats))
        torch_import = statistics.median(wall([sys.executable, "-c", "import torch"], env, base)
                                         for _ in range(args.repeats))
        rows = {}
        for c in checkouts:
            src, dcb = str(c.work / "m.safetensors"), str(c.work / "cold.dcb")
            [cold] = c.cold([["encode", src, "-o", dcb, "-q", "-f"]], args.cold_repeats)
            lossless = c.cold([["encode", src, "-o", dcb, "--lossless", "-q", "-f"],
                               ["decode", dcb, "-o", str(c.work / "cold.safetensors"), "-q", "-f"]],
                              args.lossless_repeats)
            warm = c.warm(args.repeats)
            rows[c.label] = {"first encode": statistics.median(cold),
                             "first encode --lossless": statistics.median(lossless[0]),
                             "its first decode": statistics.median(lossless[1]),
                             **{k: statistics.median(v) for k, v in warm.items()}, "torch": c.imports_torch()}
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
        shutil.rmtree(base, ignore_errors=True)

    goals = {"first encode": 15.0, "first encode --lossless": None, "its first decode": None, "encode": 1.0,
             "decode": 1.0, "info": None}
    labels = list(rows)
    print(f"deepcabac start-up, demo model ({DEMO.name}, {DEMO.stat().st_size:,} bytes); medians of "
          f"{args.cold_repeats} cold ({args.lossless_repeats} lossless) / {args.repeats} warm runs, seconds of wall "
          f"time")
    head = f"{'command':<24}" + "".join(f"{lab:>14}" for lab in labels)
    if len(labels) == 2:
        head += f"{'ratio':>9}"
    print(head + f"{'goal':>8}")
    for key in goals:
        line = f"{(key if key.startswith(('first', 'its')) else 'warm ' + key):<24}" + "".join(
            f"{rows[lab][key]:>14.2f}" for lab in labels)
        if len(labels) == 2:
            line += f"{rows[labels[1]][key] / rows[labels[0]][key]:>8.2f}x"
        goal = goals[key]
        print(line + (f"{'<= ' + format(goal, '.1f'):>8}" if goal is not None else ""))
    for lab in labels:
        t = rows[lab]["torch"]
        print(f"imports torch ({lab}): encode {'yes' if t['encode'] else 'no'}, decode {'yes' if t['decode'] else 'no'}")
    print(f"python importing numba and click: {floor:.2f} s (every command pays it, and Numba's set-up "
          f"when the first cached kernel loads); python importing torch: {torch_import:.2f} s")
    print(f"(python {sys.version.split()[0]}; scipy installed: "
          f"{'yes (numba imports it when its first kernel loads)' if _has('scipy') else 'no'})")


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
