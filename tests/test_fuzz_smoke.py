"""A short, deterministic fuzz smoke run of every decoder entry point (no atheris needed).

Each target of ``fuzz/fuzz_targets.py`` gets a few hundred inputs made from its seed corpus
(``fuzz/corpus/<target>/``) by pure-Python mutations: bit flips, byte overwrites, truncations,
insertions, deletions, duplicated ranges and splices of two seeds. The contract: every call returns
or raises a DeepCabacError (a target raises ``Finding`` otherwise) and nothing hangs.
The long coverage-guided runs are ``fuzz/run.py`` (atheris); see docs/reliability.md.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import fuzz_targets
import pytest
from helpers import no_hang
from numba.core.compiler_lock import global_compiler_lock

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"


CASES = {
    "model": 400,
    "model_sealed": 400,
    "update": 400,
    "update_sealed": 400,
    "ckpt_safetensors": 300,
    "ckpt_npz": 200,
    "ckpt_pt": 200,
    "ckpt_pt_pickle": 300,
    "model_threads": 150,
    "matrix": 200,
    "zarr": 300,
    "encode": 200,
    "info": 150,
    "session": 200,
    "metadata": 300,
    "header_sizes": 300,
    "update_sizes": 300,
    "output": 100,
}


def mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(8)
        n = len(buf)
        if op == 0 and n:  # flip one bit
            buf[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # overwrite a byte with an interesting value
            buf[rng.randrange(n)] = rng.choice((0, 1, 0x7F, 0x80, 0xFE, 0xFF, rng.randrange(256)))
        elif op == 2:  # truncate
            del buf[rng.randrange(n + 1):]
        elif op == 3:  # insert random bytes
            pos = rng.randrange(n + 1)
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4 and n:  # delete a range
            pos = rng.randrange(n)
            del buf[pos:pos + rng.randint(1, 16)]
        elif op == 5 and n:  # duplicate a range
            pos = rng.randrange(n)
            chunk = buf[pos:pos + rng.randint(1, 32)]
            at = rng.randrange(n + 1)
            buf[at:at] = chunk
        elif op == 6 and n >= 4:  # overwrite a 32-bit little-endian integer
            pos = rng.randrange(n - 3)
            value = rng.choice((0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 1 << 30, rng.randrange(1 << 32)))
            buf[pos:pos + 4] = value.to_bytes(4, "little")
        elif op == 7 and other:  # splice with another seed
            cut = rng.randrange(n + 1)
            buf = buf[:cut] + bytearray(other[rng.randrange(len(other)):])
    return bytes(buf)


@pytest.mark.parametrize("target", list(CASES))
def test_fuzz_smoke(target):
    seeds = [p.read_bytes() for p in sorted((FUZZ / "corpus" / target).iterdir())]
    assert seeds, f"no seeds for {target}: run fuzz/make_corpus.py"
    fn = fuzz_targets.TARGETS[target]
    rng = random.Random(f"deepcabac-fuzz-smoke-{target}")
    with no_hang(60):
        for seed in seeds:  # the seeds themselves are valid inputs
            fn(seed)
        for _ in range(CASES[target]):
            fn(mutate(rng, rng.choice(seeds), rng.choice(seeds)))


def test_the_hang_guard_counts_running_but_not_compiling():
    with no_hang(0.3):
        with global_compiler_lock:  # as Numba holds it while compiling a kernel
            time.sleep(0.6)
        time.sleep(0.1)
    with pytest.raises(TimeoutError, match="within 0.3 s"), no_hang(0.3):
        while True:
            time.sleep(0.01)
