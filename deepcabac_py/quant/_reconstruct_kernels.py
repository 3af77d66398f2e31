"""Numba kernels of reconstruction: quantization indices back to values.

Private: call them through :mod:`deepcabac_py.quant.reconstruct`. The 4-state machine of
dependent quantization is defined here once; the trellis (``_quantizer_kernels``) walks the same
machine when it chooses levels.
"""

import numpy as np

from .._jit import inline, kernel
from ..entropy._cabac_kernels import PREDICT_MAX_LEVEL

# The 4-state machine of dependent quantization (as in VVC): the parity of each transmitted level
# moves the state; states 0 and 1 use the even grid Q0 = {2k}, states 2 and 3 the odd grid
# Q1 = {0, +-1, +-3, ...} (a level k != 0 is 2k - sgn(k)).
N_STATES = 4
NEXT_STATE = np.array([[0, 2], [2, 0], [1, 3], [3, 1]], dtype=np.int64)
MAX_DQ_LEVEL = PREDICT_MAX_LEVEL  # |k| <= 2**30 - 1, so |2k| fits in int32


@inline
def dq_value(k, state):
    """Reconstruction index of transmitted level ``k`` in ``state`` (branch-free: the state is
    unpredictable, so a branch here would be mispredicted half the time)."""
    sgn = np.int64(k > 0) - np.int64(k < 0)
    return 2 * k - (state >> 1) * sgn


@inline
def dq_next(state, k):
    """NEXT_STATE[state, k & 1] without the table: the high bit moves down, the low bit's parity
    with k's picks the new high bit."""
    return (state >> 1) | (((state & 1) ^ (k & 1)) << 1)


# The decoder follows the state machine 64 levels at a time. Only the high bit hb of the state
# (which grid) matters for the values, and with the state as (hb, lb) a level of parity p moves it to
# (lb ^ p, hb): hb before level i is the XOR of the parities of levels i-1, i-3, i-5, ... and of the
# starting state. For a block, that is a shift-XOR prefix over a word of parity bits, and the values
# then follow element by element without a loop-carried dependency (about 5x faster than stepping
# the state level by level, which costs several cycles of latency per level).
_EVEN_BITS = np.uint64(0x5555555555555555)
_ODD_BITS = np.uint64(0xAAAAAAAAAAAAAAAA)
_DQ_BLOCK = 64


@inline
def _dq_block_high_bits(levels, i, hb, lb):
    """Bit j of the result: the state's high bit before level i + j (0 <= j < 64), given the state
    (hb, lb) before level i; and the state (hb, lb) after the block."""
    one = np.uint64(1)
    par = np.uint64(0)
    for j in range(_DQ_BLOCK):
        par |= np.uint64(levels[i + j] & 1) << np.uint64(j)
    acc = par << one  # bit j: parity of level j - 1
    acc ^= acc << np.uint64(2)  # now XOR of the parities of levels j-1, j-3, ... within the block
    acc ^= acc << np.uint64(4)
    acc ^= acc << np.uint64(8)
    acc ^= acc << np.uint64(16)
    acc ^= acc << np.uint64(32)
    high = acc ^ (_EVEN_BITS * hb) ^ (_ODD_BITS * lb)
    h_after = ((high >> np.uint64(62)) & one) ^ ((par >> np.uint64(63)) & one)
    return high, h_after, (high >> np.uint64(63)) & one


@inline
def _dq_pass(levels, out, step):
    """Reconstruction indices of transmitted levels (``step`` None: into int32 ``out``) or values
    ``index * step`` (into float32 ``out``); ``out`` may alias ``levels``. False if a level is too
    large for the grid (``out`` then holds garbage)."""
    n = levels.shape[0]
    lo = np.int32(0)
    hi = np.int32(0)
    hb = np.uint64(0)
    lb = np.uint64(0)
    i = 0
    while i + _DQ_BLOCK <= n:
        high, hb, lb = _dq_block_high_bits(levels, i, hb, lb)
        for j in range(_DQ_BLOCK):
            k = levels[i + j]
            lo = min(lo, k)
            hi = max(hi, k)
            # int32 arithmetic keeps the loop vectorized; out of range levels are refused below
            g = np.int32((high >> np.uint64(j)) & np.uint64(1))
            index = np.int32(2) * k - g * (np.int32(k > 0) - np.int32(k < 0))
            if step is None:
                out[i + j] = index
            else:
                out[i + j] = np.float32(np.float64(index) * step)
        i += _DQ_BLOCK
    state = 2 * np.int64(hb) + np.int64(lb)
    for t in range(i, n):
        k = np.int64(levels[t])
        lo = min(lo, np.int32(k))
        hi = max(hi, np.int32(k))
        if step is None:
            out[t] = dq_value(k, state)
        else:
            out[t] = np.float32(np.float64(dq_value(k, state)) * step)
        state = dq_next(state, k)
    return max(np.int64(hi), -np.int64(lo))


@kernel
def dq_reconstruct_kernel(levels, out):
    """Map transmitted levels to reconstruction indices through the state machine (state 0 at the
    start). ``out`` may alias ``levels``. Returns the largest |level| (beyond MAX_DQ_LEVEL: not a
    level of the grid, and ``out`` holds garbage)."""
    return _dq_pass(levels, out, None)


@kernel
def dq_reconstruct_f32_kernel(levels, step):
    """In place: transmitted int32 levels to float32 values ``index * step`` (same buffer). Returns
    the largest |level| (beyond MAX_DQ_LEVEL: not a level of the grid)."""
    return _dq_pass(levels, levels.view(np.float32), step)


@kernel
def uniform_f32_kernel(levels, step, out):
    """``out = float32(levels * step)``; returns the largest |level|."""
    top = np.int64(0)
    for i in range(levels.shape[0]):
        k = np.int64(levels[i])
        top = max(top, abs(k))
        out[i] = np.float32(np.float64(k) * step)
    return top


@kernel
def uniform_f32_inplace_kernel(levels, step):
    """The same, in place (element i is read before it is written, and nothing else reads it)."""
    values = levels.view(np.float32)
    top = np.int64(0)
    for i in range(levels.shape[0]):
        k = np.int64(levels[i])
        top = max(top, abs(k))
        values[i] = np.float32(np.float64(k) * step)
    return top


_BF16_BLOCK = 4096


@kernel
def uniform_bf16_kernel(indices, step, out):
    """``out`` (uint16) = the bfloat16 patterns of ``indices * step``, rounded once from the exact
    float64 product to 8 significant bits, ties to even (as :func:`reconstruct._bf16_bits`, block by
    block through float64 and float32 scratch); returns the largest |index|."""
    n = indices.shape[0]
    exact = np.empty(_BF16_BLOCK, dtype=np.float64)
    bits = exact.view(np.uint64)
    f32 = np.empty(_BF16_BLOCK, dtype=np.float32)
    f32_bits = f32.view(np.uint32)
    keep = np.uint64(0xFFFFFFFFFFFFFFFF) ^ np.uint64((1 << 45) - 1)
    half = np.uint64((1 << 44) - 1)
    one = np.uint64(1)
    top = np.int64(0)
    for start in range(0, n, _BF16_BLOCK):
        m = min(_BF16_BLOCK, n - start)
        for j in range(m):
            k = np.int64(indices[start + j])
            top = max(top, abs(k))
            exact[j] = np.float64(k) * step
        for j in range(m):
            # (an infinity stays one: its mantissa is 0 and the rounding carries nothing into it)
            b = bits[j]
            bits[j] = (b + half + ((b >> np.uint64(45)) & one)) & keep
        for j in range(m):
            f32[j] = np.float32(exact[j])
        for j in range(m):
            out[start + j] = np.uint16(f32_bits[j] >> np.uint32(16))
    return top


@inline
def _from_table(index, table, half, out, i):
    """``out[i]`` from the table when ``index`` is in it; 1 where it is not."""
    if abs(index) <= half:
        out[i] = table[np.uint64(index + half)]
        return 0
    return 1


@kernel
def table_bf16_kernel(indices, table, out):
    """bfloat16 patterns by look-up: ``out[i] = table[indices[i] + half]`` for the indices within
    the table's ``half`` (its length is ``2 * half + 1``), the exact rounding done once per small
    index instead of once per element. Returns the largest |index| and how many indices fall outside
    the table (their ``out`` is left for the caller)."""
    half = (table.shape[0] - 1) >> 1
    top = np.int64(0)
    outside = 0
    for i in range(indices.shape[0]):
        index = np.int64(indices[i])
        top = max(top, abs(index))
        outside += _from_table(index, table, half, out, i)
    return top, outside
