"""Hypothesis mutation tests of the decoder entry points, in the normal suite.

Hypothesis picks a seed input of a fuzz target (``fuzz/corpus/<target>/``) and a list of edits
(bit flips, byte and 32-bit overwrites, truncation, insertion, deletion); the target must return or
raise a DeepCabacError (``fuzz_targets.Finding`` otherwise). Where a failure exists, hypothesis
shrinks it to a minimal edit list of one seed. The long coverage-guided runs are ``fuzz/run.py``.
"""

from __future__ import annotations

from pathlib import Path

import fuzz_targets
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"


TARGETS = ["model_sealed", "model_threads", "matrix", "zarr", "update_sealed", "ckpt_safetensors", "ckpt_npz",
           "ckpt_pt_pickle", "info", "encode", "session", "metadata", "header_sizes", "update_sizes", "output"]

_edit = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 1 << 20), st.sampled_from([0, 1, 0x7F, 0x80, 0xFF])),
    st.tuples(st.just("u32"), st.integers(0, 1 << 20),
              st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 24, 1 << 31])),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 16)),
)


def apply_edits(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for kind, pos, arg in edits:
        n = len(buf)
        at = pos % (n + 1)
        if kind == "flip" and n:
            buf[at % n] ^= 1 << arg
        elif kind == "set" and n:
            buf[at % n] = arg
        elif kind == "u32" and n >= 4:
            at %= n - 3
            buf[at:at + 4] = arg.to_bytes(4, "little")
        elif kind == "truncate":
            del buf[at:]
        elif kind == "insert":
            buf[at:at] = bytes([arg])
        elif kind == "delete":
            del buf[at:at + arg]
    return bytes(buf)


def _seeds(target: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((FUZZ / "corpus" / target).iterdir())]


@pytest.mark.parametrize("target", TARGETS)
def test_mutated_inputs_keep_the_contract(target):
    seeds = _seeds(target)
    fn = fuzz_targets.TARGETS[target]

    @settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(seed=st.sampled_from(seeds), edits=st.lists(_edit, min_size=1, max_size=4))
    def check(seed, edits):
        fn(apply_edits(seed, edits))

    check()
