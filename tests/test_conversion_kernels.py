"""The bfloat16 kernels of the streaming path against plain-Python references: reconstruction to
bfloat16 patterns (rounded once from the exact float64 product) and bfloat16 to float32."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from reference_quantizers import dq_indices

from deepcabac_py.model import _planning_kernels
from deepcabac_py.quant import _reconstruct_kernels
from deepcabac_py.quant.reconstruct import reconstruct_bf16_into
from deepcabac_py.quant.steps import step_from_qp


def bf16_of(value: float) -> int:
    """The bfloat16 pattern of a float64, rounded to 8 significant bits (ties to even) on its own
    bits, then narrowed to float32 (exact) and cut to its top half."""
    (b,) = struct.unpack("<Q", struct.pack("<d", value))
    b = (b + (1 << 44) - 1 + ((b >> 45) & 1)) & ~((1 << 45) - 1) & 0xFFFFFFFFFFFFFFFF
    (rounded,) = struct.unpack("<d", struct.pack("<Q", b))
    (f32,) = struct.unpack("<I", struct.pack("<f", rounded)) if abs(rounded) < 2.0**128 else (
        struct.unpack("<I", struct.pack("<f", float("inf") if rounded > 0 else float("-inf"))))
    return f32 >> 16


levels = st.lists(st.integers(-2**30 + 1, 2**30 - 1), min_size=1, max_size=300)


@settings(max_examples=60, deadline=None)
@given(levels, st.integers(-600, 400))
@example([267911168], 400)  # (rounds to 2**128: infinity, which the reference once failed to pack)
def test_bf16_reconstruction_kernel_matches_the_reference(values, qp):
    step = step_from_qp(qp, 2)
    indices = np.array(values, dtype=np.int32)
    out = np.empty(indices.size, dtype=np.uint16)
    top = _reconstruct_kernels.uniform_bf16_kernel(indices, step, out)
    assert top == max(abs(v) for v in values)
    assert out.tolist() == [bf16_of(float(v) * step) for v in values]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-2**20, 2**20), min_size=1, max_size=5000), st.integers(-80, 0))
def test_trellis_levels_reconstruct_through_the_state_machine(values, qp):
    step = step_from_qp(qp, 2)
    levels = np.array(values, dtype=np.int32)
    out = np.empty(levels.size, dtype=np.uint16)
    reconstruct_bf16_into(levels.copy(), step, out, dependent=True)
    assert out.tolist() == [bf16_of(float(i) * step) for i in dq_indices(values)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=0, max_size=3000))
def test_bfloat16_to_float32_kernel_matches_the_reference(patterns):
    bits = np.array(patterns, dtype=np.uint16)
    out = np.empty(bits.size, dtype=np.float32)
    _planning_kernels.bfloat16_to_float32(bits, out)
    assert out.view(np.uint32).tolist() == [p << 16 for p in patterns]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=0, max_size=3000))
@example([0x7F80, 0x0001])  # infinity
@example([0x8000, 0x0000])  # only zeros, one negative
def test_bfloat16_range_on_the_bits_matches_the_float_pass(patterns):
    bits = np.array(patterns, dtype=np.uint16)
    values = (bits.astype(np.uint32) << 16).view(np.float32)
    assert _planning_kernels.bfloat16_range(bits) == _planning_kernels.float_range(values)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([(np.uint32, 32), (np.uint64, 64)]).flatmap(
    lambda w: st.tuples(st.just(w), st.lists(st.integers(0, 2**w[1] - 1), min_size=0, max_size=2000))))
@example(((np.uint32, 32), [0x7F800000, 1]))  # infinity, the smallest denormal
@example(((np.uint32, 32), [0x80000000, 0x7FC00001]))  # negative zero, a NaN with a payload
@example(((np.uint64, 64), [0xFFF0000000000000, 0x7FEFFFFFFFFFFFFF]))  # -infinity, the largest finite
def test_the_float_range_by_the_bits_matches_the_values(case):
    (words, width), patterns = case
    values = np.array(patterns, dtype=words).view(np.float32 if width == 32 else np.float64)
    finite = [abs(float(x)) for x in values if np.isfinite(x)]
    reference = (max(finite, default=0.0), len(finite) == len(values))
    assert _planning_kernels.float_range(values) == reference
    assert _planning_kernels._float_range_by_value(values) == reference  # (what other dtypes take)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(-60, 10), st.sampled_from([3, 300, 5000]), st.booleans())
def test_table_reconstruction_of_large_chunks_matches_the_reference(seed, qp, spread, dependent):
    # chunks of 16,384 elements or more go through the table of small indices; indices beyond it
    # (spread 5000) are rounded one by one
    rng = np.random.default_rng(seed)
    values = np.round(rng.laplace(0, spread / 4, 20_000)).clip(-2**20, 2**20).astype(np.int32)
    step = step_from_qp(qp, 2)
    out = np.empty(values.size, dtype=np.uint16)
    reconstruct_bf16_into(values.copy(), step, out, dependent=dependent)
    indices = dq_indices(values.tolist()) if dependent else values.tolist()
    assert out.tolist() == [bf16_of(float(i) * step) for i in indices]
