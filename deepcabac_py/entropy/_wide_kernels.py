"""Numba kernels of the float coder's low-bit mode 4 (private: :mod:`.floatcoder` is the front).

Mode 4 takes the chunks of bf16, fp16 and fp32 that drop no low bit, as modes 0 and 1 do with tANS,
and codes their symbols (exponent and ``TOP_BITS`` mantissa bits, by the segment's class) with 64
interleaved rANS states instead of four tANS states: the decoder then takes sixteen elements at a
time in vector registers, one gather of their table entries, one expanding load of the words the
sixteen states renormalise with, their raw bits cut from one load. A scalar tANS step is bound by
its instructions (about 1.3 ns per element on MiniLM's bf16 word embeddings, 1.5 on fp32,
scratch, Zen 4); the sixteen-wide steps decode those chunks at about 0.9 ns per element with
AVX-512. With AVX2 (Zen 3) the steps take 0.94 ns per element on that bf16 chunk against tANS's 1.65
there, one element at a time 3.0 (:mod:`._vector_kernels` says how each tier does a step).

Element i uses state ``16 * (g % 4) + i % 16`` of group ``g = i // 16``: four sets of sixteen
states take turns, so that one group's gather latency overlaps the next three. A group decodes its
sixteen symbols, then renormalises the states that fell below ``WIDE_L`` in lane order, each with
the next 16-bit word of one shared stream. The encoder runs it backwards. Layout: docs/format.md §4.4.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .._jit import copy_bytes, helper, inline, kernel
from ._float_kernels import (
    _U,
    ERR_BAD_END,
    ERR_OVERRUN,
    ERR_TRAILING,
    MAX_CLASSES_LOG2,
    OK,
    TOP_BITS,
    _raw_at,
    _raw_near,
)
from ._tans_kernels import (
    _TZ_L,
    ERR_PRECISION,
    ERR_SHORT,
    TANS_MAX_BITS,
    TZ_ALPHABET,
    TZ_BITS,
    TZ_CAP,
    _u32_at,
    class_tables_at,
    classes_and_tables,
    counted_at,
    put_class_tables,
    put_u32,
    raw_field_status,
    raw_words_most,
    split_and_choose,
    table_bytes_most,
    tans_substream,
    tz_front,
    tz_layout,
    tz_raw_left,
    tz_raw_words,
    tz_value,
)
from ._vector_kernels import GROUP, I8, I16, I32, I64, VECTOR_LEVEL, VECTOR_STEPS, Step, fields, window

WIDE_LANES = 64  # four sets of sixteen states
WIDE_L = 1 << 16  # states stay in [WIDE_L, 2**32); renormalisation moves 16 bits
# the tables' precision at most: tANS's (a 16-bit chunk's tables are chosen once, for either mode),
# and 2**16 >> 13 leaves a decoded state 8 or more, which one renormalisation brings back above 2**16
WIDE_MAX_BITS = TANS_MAX_BITS
# Tables whose frequencies are at most 2**12 (no symbol takes more than half of 2**13 slots) and
# whose used symbols lie within 2**8 of the lowest take 4-byte entries: (frequency - 1) <<
# NARROW_FREQ_AT | distance from the symbol's start << NARROW_DISTANCE_AT | symbol - lowest
NARROW_FREQ = 1 << 12
NARROW_FREQ_AT = 20
NARROW_DISTANCE_AT = 8
# decode_wide_substream's own errors (the others are the tANS kernel's)
ERR_WIDE_PRECISION = -17  # detail[0]: the tables' precision, outside 1 to WIDE_MAX_BITS
ERR_WIDE_STATE = -18  # detail[0]: an initial state below WIDE_L
WIDE_BYTE = 0x84  # mode 4's mode byte
TZ_WIDE_BYTE = 0x85  # mode 5's

@helper
def _symbol_shifts(M):
    """Where mode 4 moves a symbol into place in the float (``M`` mantissa bits) from an 8-byte
    entry: (by the decoder's table, by the step). A 16-bit float's symbol fits the entry's 16 bits
    in place; a float32's does not, and the step shifts it. (From a 4-byte entry the step shifts
    every symbol: it is stored less the lowest.)"""
    return (0, M - TOP_BITS) if M == 23 else (M - TOP_BITS, 0)


def _states(v, lane0, precision):
    """A decoder step's sixteen states (argument 0 from ``lane0``): (where they are, the states,
    the precision as an int32, the mask of a state's slot in its table row)."""
    b = v.b
    states_at = v.at(0, lane0, I32)
    x = b.load(states_at, align=4)
    bits = b.trunc(precision, I32)
    return states_at, x, bits, b.sub(b.shl(ir.Constant(I32, 1), bits), ir.Constant(I32, 1))


def _entries(v, states_at, slots, lo, hi, split, halves=False):
    """The table entries (argument 2) of the states at ``states_at``, each at its bits below
    ``slots`` (:meth:`Step.lookup`)."""
    return v.lookup(2, v.b.bitcast(states_at, I32.as_pointer()), slots, lo, hi, split, halves)


def _renormalised(v, states_at, x, p):
    """Store the decoded states ``x``, those below WIDE_L first taking the next words (argument 6,
    from ``p``) in lane order, by an expanding load (:meth:`Step.expanded_words`); returns the next
    word's index. AVX2 compares each half on its own: the mask of a half then comes from its
    compare in one instruction, where the mask of sixteen lanes took six and a split, on the path
    from one group's states to the next's words (MiniLM's bf16 chunks decoded in 0.85 ns per element
    instead of 0.93, scratch, Zen 3)."""
    b = v.b
    parts = []
    for xh in [x] if VECTOR_LEVEL == "avx512" else [v.half(x, h) for h in range(2)]:
        lanes = xh.type.count
        need = b.icmp_unsigned("<", xh, v.const(I32, [WIDE_L] * lanes))
        w, p = v.expanded_words(6, p, need)
        parts.append(b.select(need, b.or_(b.shl(xh, v.const(I32, [16] * lanes)), w), xh))
    b.store(v.joined(parts), states_at, align=4)
    return p


def _decode_step(W, M):
    """The decoder's step for a whole group of floats of ``W`` (16 or 32) bits, ``M`` mantissa
    bits: the raw bits of ``k = M - TOP_BITS + 1`` bits per element (the element's are bits
    ``i * k`` to ``i * k + k`` of the raw bytes, its sign on top), cut from one load of
    :func:`window` bytes; arguments (states, lane0, table, base_lo, base_hi, split, words, p, raw,
    out, i, precision), what :func:`_group_elements` does for the group; returns the next word's
    index."""
    k = M - TOP_BITS + 1
    low = k - 1
    size = window.py_func(k)
    # lane l's raw bits lie in the two (16-bit floats: k + 7 <= 16 bits) or four bytes from its
    # field's first on
    first, shifts = fields(k)
    pick = [first[lane] + j for lane in range(GROUP) for j in range(W // 8)]
    It = I16 if W == 16 else I32

    @intrinsic
    def step(typingctx, states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
        narrow = table.dtype.bitwidth == 32
        # (bfloat16 into 32-bit words: low-bit mode 6's float32 chunk of bfloat16 values, each the
        # upper half of its float, stored at once instead of widened in a pass of its own)
        widen = M == 7 and out.dtype.bitwidth == 32

        def codegen(context, builder, signature, args):
            v = Step(context, builder, signature, args)
            b = builder
            _, lane0_, _, lo, hi, split_, _, p_, _, _, i_, precision_, sym0_ = args
            states_at, x, bits, slots = _states(v, lane0_, precision_)
            if narrow:  # (4-byte entries: a class's 2**13 slots take 32 KB)
                entry = _entries(v, states_at, slots, lo, hi, split_)
                freq = b.add(b.lshr(entry, v.const(I32, [NARROW_FREQ_AT] * GROUP)), v.const(I32, [1] * GROUP))
                bias = b.and_(b.lshr(entry, v.const(I32, [NARROW_DISTANCE_AT] * GROUP)),
                              v.const(I32, [NARROW_FREQ - 1] * GROUP))
                symbol = b.add(b.and_(entry, v.const(I32, [(1 << NARROW_DISTANCE_AT) - 1] * GROUP)),
                               v.splat(b.trunc(sym0_, I32), I32))
                symbol = b.shl(symbol, v.const(I32, [M - TOP_BITS] * GROUP))
                symbol = b.trunc(symbol, v.vec(It)) if W == 16 else symbol
            else:
                # the slot's frequency (bits 32 on), its distance from the symbol's start (16 to 31)
                # and the symbol (0 to 15; where a 16-bit float holds it, for the others shifted here)
                # (the low half: the distance from the symbol's start, 16 to 31, and the symbol)
                half, freq = _entries(v, states_at, slots, lo, hi, split_, halves=True)
                bias = b.lshr(half, v.const(I32, [16] * GROUP))
                symbol = b.trunc(half, v.vec(I16))
                if W == 32:
                    symbol = b.shl(b.zext(symbol, v.vec(I32)), v.const(I32, [_symbol_shifts.py_func(M)[1]] * GROUP))
            x = b.add(b.mul(freq, b.lshr(x, v.splat(bits, I32))), bias)
            # the raw bits of the sixteen elements from one load
            raw_at = v.at(8, b.lshr(b.mul(i_, ir.Constant(I64, k)), ir.Constant(I64, 3)), I8)
            raw_bytes = b.load(b.bitcast(raw_at, v.vec(I8, size).as_pointer()), align=1)
            lanes = b.shuffle_vector(raw_bytes, ir.Constant(v.vec(I8, size), ir.Undefined), v.const(I32, pick))
            r = b.and_(b.lshr(b.bitcast(lanes, v.vec(It)), v.const(It, shifts)), v.const(It, [(1 << k) - 1] * GROUP))
            value = b.or_(symbol, b.and_(r, v.const(It, [(1 << low) - 1] * GROUP)))
            value = b.or_(value, b.shl(b.lshr(r, v.const(It, [low] * GROUP)), v.const(It, [W - 1] * GROUP)))
            if widen:
                b.store(b.shl(b.zext(value, v.vec(I32)), v.const(I32, [16] * GROUP)), v.at(9, i_, I32), align=4)
            else:
                b.store(value, v.at(9, i_, It), align=W // 8)
            return _renormalised(v, states_at, x, p_)

        return (types.int64(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0),
                codegen)

    return step


def _tz_step():
    """The decoder's step for a whole group of mode 5 (low-bit mode 3's symbols and raw bits on
    mode 4's states): as :func:`_decode_step`'s for float32, with 8-byte entries, but each element's
    raw bits as long as its symbol's trailing-zero count says (:func:`tz_layout`), one after another from
    bit ``at`` of the raw bytes: their offsets summed across the lanes, each lane's four bytes
    picked from one 64-byte load by a byte permute. Arguments (states, lane0, table, base_lo,
    base_hi, split, words, p, raw, out, i, precision, at); returns the next word's index | the next
    raw bit's << 32."""

    @intrinsic
    def step(typingctx, states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, at):
        def codegen(context, builder, signature, args):
            v = Step(context, builder, signature, args)
            b = builder
            _, lane0_, _, lo, hi, split_, _, p_, _, _, i_, precision_, at_ = args
            states_at, x, bits, slots = _states(v, lane0_, precision_)
            half, freq = _entries(v, states_at, slots, lo, hi, split_, halves=True)
            bias = b.lshr(half, v.const(I32, [16] * GROUP))
            symbol = b.and_(half, v.const(I32, [0xFFFF] * GROUP))
            x = b.add(b.mul(freq, b.lshr(x, v.splat(bits, I32))), bias)
            # each lane's raw bit count, their mask, the shift of the bits above the sign and the
            # implied lowest set bit, by its capped count c (one permute each: TZ_CAP + 1 = 16 lanes)
            c = b.and_(symbol, v.const(I32, [TZ_CAP] * GROUP))
            layout = [tz_layout.py_func(j) for j in range(GROUP)]
            k = v.lookup16([int(n) for n, _, _ in layout], c)
            ones = v.lookup16([(1 << int(n)) - 1 for n, _, _ in layout], c)
            shift = v.lookup16([int(s) for _, s, _ in layout], c)
            implied = v.lookup16([int(m) for _, _, m in layout], c)
            # their sums, eight lanes at a time in the bytes of a 64-bit word (at most 8 (TZ_L + 1) < 256):
            # a multiply by 0x0101010101010101 adds each byte to those above it
            pairs = b.bitcast(b.trunc(k, v.vec(I8)), v.vec(I64, 2))
            sums = b.bitcast(b.mul(pairs, v.const(I64, [0x0101010101010101] * 2)), v.vec(I8))
            total = b.zext(sums, v.vec(I32))
            zero = ir.Constant(v.vec(I32), None)
            total = b.add(total, b.shuffle_vector(total, zero, v.const(I32, [GROUP] * 8 + [7] * 8)))
            offset = b.add(b.sub(total, k), v.splat(b.trunc(b.and_(at_, ir.Constant(I64, 7)), I32), I32))
            # (a lane's bits start in its first byte at most 7 bits up: 7 + TZ_L + 1 bits fit its four bytes)
            first = b.lshr(offset, v.const(I32, [3] * GROUP))
            r = v.words_at(8, b.lshr(at_, ir.Constant(I64, 3)), first)
            r = b.lshr(r, b.and_(offset, v.const(I32, [7] * GROUP)))
            r = b.and_(r, ones)
            # the float: the sign (the raw bits' first), the symbol above the low bits, the rest of
            # the raw bits above the lowest set one (implied below the cap)
            value = b.or_(b.shl(r, v.const(I32, [31] * GROUP)),
                          b.shl(b.lshr(symbol, v.const(I32, [TZ_BITS] * GROUP)), v.const(I32, [_TZ_L] * GROUP)))
            low = b.or_(b.shl(b.lshr(r, v.const(I32, [1] * GROUP)), shift), implied)
            b.store(b.or_(value, low), v.at(9, i_, I32), align=4)
            used = b.zext(b.extract_element(total, ir.Constant(I32, GROUP - 1)), I64)
            return b.or_(_renormalised(v, states_at, x, p_), b.shl(b.add(at_, used), ir.Constant(I64, 32)))

        return (types.int64(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, at),
                codegen)

    return step


def _double_quotient(v, x, f):
    """x div f and x mod f (x < 2**32, f <= 2**13) exactly: the double quotient never rounds up
    to the next integer."""
    b = v.b
    q = b.fptoui(b.fdiv(b.uitofp(x, v.vec(ir.DoubleType())), b.uitofp(f, v.vec(ir.DoubleType()))), v.vec(I32))
    return q, b.sub(x, b.mul(q, f))


def _quotient(v, x, f, precision):
    """x div f and x mod f for the encoder's step (x < f << (32 - precision), f <= 2**13). A
    precision of 10 or more (the quotient below 2**22) goes in single precision: x and x / f, each
    rounded once, leave the quotient within 0.51 of the exact one, and a step down or up puts the
    remainder in [0, f); below that, :func:`_double_quotient`. A single-precision division of
    sixteen lanes takes one instruction where doubles take two, each slower: MiniLM's fp16 chunks
    encoded in 1.25 ms per million elements instead of 1.38 with AVX-512 (scratch, medians of 50);
    with AVX2, where converting between 32-bit unsigned integers and doubles takes five
    instructions each way, 2.49 ns per element instead of 2.66 (MiniLM's bf16, scratch, Zen 3).
    AVX2 has no unsigned conversion to single precision: x goes in as its two halves."""
    b = v.b
    single = v.vec(ir.FloatType())
    zero = ir.Constant(v.vec(I32), None)
    with b.if_else(b.icmp_signed(">=", precision, ir.Constant(I64, 10))) as (fast, slow):
        with fast:
            if VECTOR_LEVEL == "avx512":
                xf = b.uitofp(x, single)
            else:  # (the high half times 2**16 is exact: the sum is x rounded once)
                xf = b.fadd(b.fmul(b.sitofp(b.lshr(x, v.const(I32, [16] * GROUP)), single),
                                   v.const(ir.FloatType(), [65536.0] * GROUP)),
                            b.sitofp(b.and_(x, v.const(I32, [0xFFFF] * GROUP)), single))
            q1 = b.fptosi(b.fdiv(xf, b.sitofp(f, single)), v.vec(I32))
            r1 = b.sub(x, b.mul(q1, f))  # (in (-f, 2 f): its low 32 bits are it)
            low = b.icmp_signed("<", r1, zero)
            q1 = b.add(q1, b.sext(low, v.vec(I32)))
            r1 = b.add(r1, b.select(low, f, zero))
            high = b.icmp_signed(">=", r1, f)
            q1 = b.sub(q1, b.sext(high, v.vec(I32)))
            r1 = b.sub(r1, b.select(high, f, zero))
            fast_end = b.block
        with slow:
            q2, r2 = _double_quotient(v, x, f)
            slow_end = b.block
    q, r = b.phi(v.vec(I32)), b.phi(v.vec(I32))
    for phi, one, other in ((q, q1, q2), (r, r1, r2)):
        phi.add_incoming(one, fast_end)
        phi.add_incoming(other, slow_end)
    return q, r


@intrinsic
def _vector_encode16(typingctx, states, lane0, table, base_lo, base_hi, split, symbols, i, pushed, t, precision):
    """The encoder's step for the whole group of elements i to i + 15 (what the decoder's step
    undoes), table rows as the decoder's; ``table`` holds each symbol's frequency | start << 16
    (4-byte entries). The words the group pushes go just before
    ``pushed[t]``, in lane order (the groups go from the last to the first, so the words come out
    in the stream's order), in stores that reach at most sixteen words below ``t``, the words
    below the group's for the next group to overwrite; returns the next ``t``."""
    def codegen(context, builder, signature, args):
        v = Step(context, builder, signature, args)
        b = builder
        _, lane0_, _, lo, hi, split_, _, i_, _, t_, precision_ = args
        states_at = v.at(0, lane0_, I32)
        x = b.load(states_at, align=4)
        entry = v.lookup(2, b.bitcast(v.at(6, i_, I16), I16.as_pointer()), None, lo, hi, split_)
        f = b.and_(entry, v.const(I32, [0xFFFF] * GROUP))
        start = b.lshr(entry, v.const(I32, [16] * GROUP))
        # (x >= f << (32 - precision), in 32 bits)
        push = b.icmp_unsigned(">=", b.lshr(x, v.splat(b.trunc(b.sub(ir.Constant(I64, 32), precision_), I32), I32)),
                               f)
        count = v.stored_before(8, t_, x, push)
        x = b.select(push, b.lshr(x, v.const(I32, [16] * GROUP)), x)
        q, r = _quotient(v, x, f, precision_)
        x = b.add(b.add(b.shl(q, v.splat(b.trunc(precision_, I32), I32)), r), start)
        b.store(x, states_at, align=4)
        return b.sub(t_, count)

    return (types.int64(states, lane0, table, base_lo, base_hi, split, symbols, i, pushed, t, precision), codegen)


@inline
def _group_elements(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, m, precision, sym0, M,
                    checked):
    """Elements i to i + m - 1 (m <= 16) of a group of floats of ``M`` mantissa bits one at a time,
    each decoded and its state renormalised at once (the vector step's reads in the same order: a
    state's word comes after those of the lanes before it): (the next word's index, OK or
    ERR_OVERRUN). With ``checked`` every read is checked; without, they are the vector step's (16
    words from ``p`` at most, eight bytes from each element's raw bits inside the group's window)."""
    k = M - TOP_BITS + 1
    top = 31 if M == 23 else 15  # (the sign's bit)
    shift = _symbol_shifts(M)[1]
    mask = (np.int64(1) << precision) - 1
    low = (np.int64(1) << (k - 1)) - 1
    for lane in range(m):
        at = (i + lane) * k
        r = _raw_at(raw, at, k) if checked else _raw_near(raw, at, k)
        x = np.int64(states[lane0 + lane])
        e = np.int64(table[_U((base_lo if lane < split else base_hi) + (x & mask))])
        if table.itemsize == 4:
            x = ((e >> NARROW_FREQ_AT) + 1) * (x >> precision) + ((e >> NARROW_DISTANCE_AT) & (NARROW_FREQ - 1))
            symbol = ((e & ((1 << NARROW_DISTANCE_AT) - 1)) + sym0) << (M - TOP_BITS)
        else:
            x = (e >> 32) * (x >> precision) + ((e >> 16) & 0xFFFF)
            symbol = (e & 0xFFFF) << shift
        value = ((r >> (k - 1)) << top) | symbol | (r & low)
        out[_U(i + lane)] = value << 16 if M == 7 and out.itemsize == 4 else value  # (mode 6: see the vector step)
        x, p, ok = _renormalise(x, words, p, checked)
        if not ok:
            return p, ERR_OVERRUN
        states[lane0 + lane] = np.uint32(x)
    return p, OK


@inline
def _renormalise(x, words, p, checked):
    """A decoded state below WIDE_L takes the next word (from ``p``): (the state, the next word's
    index, whether there was one). Without ``checked``, the word at ``p`` must be there."""
    if checked:
        if x < WIDE_L:
            if p >= words.shape[0]:
                return x, p, False
            return (x << 16) | np.int64(words[p]), p + 1, True
        return x, p, True
    need = np.int64(x < WIDE_L)  # (without a branch: taken for about one element in three, unpredictably)
    return (x << (16 * need)) | (np.int64(words[_U(p)]) & -need), p + need, True


@inline
def _encode_checked(states, lane0, table, base_lo, base_hi, split, symbols, i, m, pushed, t, precision):
    """Elements i to i + m - 1 (m <= 16) of a group, one at a time: what the vector step does for a
    whole group; the next ``t``."""
    for lane in range(m - 1, -1, -1):
        e = table[(base_lo if lane < split else base_hi) + np.int64(symbols[i + lane])]
        f = np.int64(e & 0xFFFF)
        x = np.int64(states[lane0 + lane])
        if x >= f << (32 - precision):
            t -= 1
            pushed[t] = np.uint16(x & 0xFFFF)
            x >>= 16
        states[lane0 + lane] = np.uint32(((x // f) << precision) + x % f + (np.int64(e) >> 16))
    return t



@inline
def _tz_elements(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, m, precision, at, checked):
    """Elements i to i + m - 1 (m <= 16) of a mode 5 group one at a time, as :func:`_group_elements`
    takes mode 4's, each element's raw bits from bit ``at`` on: (the next word's index, the next raw
    bit, OK or ERR_OVERRUN). Without ``checked``, eight bytes from each element's raw bits and 16
    words from ``p`` must be there."""
    mask = (np.int64(1) << precision) - 1
    for lane in range(m):
        x = np.int64(states[lane0 + lane])
        e = np.int64(table[_U((base_lo if lane < split else base_hi) + (x & mask))])
        x = (e >> 32) * (x >> precision) + ((e >> 16) & 0xFFFF)
        symbol = e & 0xFFFF
        k, shift, implied = tz_layout(symbol & TZ_CAP)
        if checked and at + k > 32 * raw.shape[0]:
            return p, at, ERR_OVERRUN
        r = _raw_at(raw, at, k) if checked else _raw_near(raw, at, k)
        at += k
        out[_U(i + lane)] = tz_value(symbol >> TZ_BITS, r, shift, implied)
        x, p, ok = _renormalise(x, words, p, checked)
        if not ok:
            return p, at, ERR_OVERRUN
        states[lane0 + lane] = np.uint32(x)
    return p, at, OK


if not VECTOR_STEPS:
    # (an intrinsic runs compiled only, and fast on the processors above only: one element at a time)
    @inline
    def _group_bf16(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
        return _group_elements(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, GROUP,
                               precision, sym0, 7, False)[0]

    @inline
    def _group_fp16(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
        return _group_elements(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, GROUP,
                               precision, sym0, 10, False)[0]

    @inline
    def _group_fp32(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
        return _group_elements(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, GROUP,
                               precision, sym0, 23, False)[0]

    @inline
    def _encode16(states, lane0, table, base_lo, base_hi, split, symbols, i, pushed, t, precision):
        return _encode_checked(states, lane0, table, base_lo, base_hi, split, symbols, i, GROUP, pushed, t,
                               precision)

    @inline
    def _group_tz(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, at):
        p, at, _ = _tz_elements(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, GROUP,
                                precision, at, False)
        return p | (at << 32)
else:
    _vector_bf16 = _decode_step(16, 7)
    _vector_fp16 = _decode_step(16, 10)
    _vector_fp32 = _decode_step(32, 23)
    _vector_tz = _tz_step()

    if numba.config.BOUNDSCHECK:
        # (the fuzz targets run with bounds checks: the vector step checks what it will touch as an
        # index would)
        @inline
        def _in_bounds(states, lane0, table, base_lo, base_hi, words, p, raw, out, i, precision, k):
            if (lane0 < 0 or lane0 + GROUP > states.shape[0] or p < 0 or p + GROUP > words.shape[0]
                    or i < 0 or i + GROUP > out.shape[0] or ((i * k) >> 3) + window(k) > 4 * raw.shape[0]
                    or min(base_lo, base_hi) < 0
                    or max(base_lo, base_hi) + (np.int64(1) << precision) > table.shape[0]):
                raise IndexError("a vector step outside its arrays")

        @inline
        def _group_bf16(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
            _in_bounds(states, lane0, table, base_lo, base_hi, words, p, raw, out, i, precision, 6)
            return _vector_bf16(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision,
                                  sym0)

        @inline
        def _group_fp16(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
            _in_bounds(states, lane0, table, base_lo, base_hi, words, p, raw, out, i, precision, 9)
            return _vector_fp16(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision,
                                  sym0)

        @inline
        def _group_fp32(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0):
            _in_bounds(states, lane0, table, base_lo, base_hi, words, p, raw, out, i, precision, 22)
            return _vector_fp32(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision,
                                  sym0)

        @inline
        def _group_tz(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, at):
            if (lane0 < 0 or lane0 + GROUP > states.shape[0] or p < 0 or p + GROUP > words.shape[0]
                    or i < 0 or i + GROUP > out.shape[0] or at < 0 or (at >> 3) + 64 > 4 * raw.shape[0]
                    or min(base_lo, base_hi) < 0
                    or max(base_lo, base_hi) + (np.int64(1) << precision) > table.shape[0]):
                raise IndexError("a vector step outside its arrays")
            return _vector_tz(states, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, at)

        @inline
        def _encode16(states, lane0, table, base_lo, base_hi, split, symbols, i, pushed, t, precision):
            if (lane0 < 0 or lane0 + GROUP > states.shape[0] or i < 0 or i + GROUP > symbols.shape[0]
                    or t < GROUP or t > pushed.shape[0] or min(base_lo, base_hi) < 0):
                raise IndexError("a vector step outside its arrays")
            return _vector_encode16(states, lane0, table, base_lo, base_hi, split, symbols, i, pushed, t, precision)
    else:
        _group_bf16 = _vector_bf16
        _group_fp16 = _vector_fp16
        _group_fp32 = _vector_fp32
        _group_tz = _vector_tz
        _encode16 = _vector_encode16


@inline
def _vector_run(xs, g, count, table, base, words, p, raw, out, precision, sym0, M):
    """``count`` whole groups from group ``g`` on, all in one segment (of table row ``base``), by
    the vector step: the next word's index. (Per group, only the step: the segment's bookkeeping
    around every group had cost a quarter of the decode, scratch.)"""
    if M == 7:
        for h in range(g, g + count):
            p = _group_bf16(xs, (h & 3) * GROUP, table, base, base, GROUP, words, p, raw, out, GROUP * h, precision,
                            sym0)
    elif M == 10:
        for h in range(g, g + count):
            p = _group_fp16(xs, (h & 3) * GROUP, table, base, base, GROUP, words, p, raw, out, GROUP * h, precision,
                            sym0)
    else:
        for h in range(g, g + count):
            p = _group_fp32(xs, (h & 3) * GROUP, table, base, base, GROUP, words, p, raw, out, GROUP * h, precision,
                            sym0)
    return p


@inline
def _tz_run(xs, g, count, table, base, words, p, raw, out, precision, at):
    """:func:`_vector_run` for mode 5: (the next word's index, the next raw bit)."""
    for h in range(g, g + count):
        packed = _group_tz(xs, (h & 3) * GROUP, table, base, base, GROUP, words, p, raw, out, GROUP * h, precision, at)
        p, at = packed & 0xFFFFFFFF, packed >> 32
    return p, at


# the most raw bytes a group of mode 5 takes (sixteen of TZ_L + 1 bits), and what its step loads
TZ_GROUP_BYTES = (GROUP * (_TZ_L + 1) + 7) // 8
TZ_WINDOW = 64


@kernel
def decode_wide(words, raw, states, seg_len, M, classes, precision, table, sym0, out, tz):
    """Rebuild ``out`` (the bits of a chunk of bf16, fp16 or fp32 floats, as uint16 or uint32; bf16
    into uint32, each word the upper half of its float: low-bit mode 6) from
    its rANS ``words``, its ``raw`` words (exactly those of its n * k bits, u32), the decoder's 64
    initial ``states`` (each at least WIDE_L: the front checks), its segments' classes,
    :func:`_fill_table`'s ``table`` and the lowest symbol ``sym0`` its 4-byte entries count
    from; OK or an error code. With ``tz``, mode 5 (float32, 8-byte entries): the raw bits as long as
    each symbol says, ``raw`` all the words left (every one of them must be used). The vector steps
    run in stretches that cannot reach the end of the words or of the raw bytes; the rest goes one
    element at a time, each read checked."""
    n = out.shape[0]
    k = M - TOP_BITS + 1
    R = np.int64(1) << precision
    xs = states.copy()
    p = np.int64(0)
    groups = (n + GROUP - 1) // GROUP
    full = n // GROUP
    seg = 0
    seg_end = min(seg_len, n)
    g = 0
    at = np.int64(0)  # (mode 5's next raw bit)
    while g < groups:
        i = GROUP * g
        while i >= seg_end:
            seg += 1
            seg_end = min(seg_end + seg_len, n)
        base_lo = np.int64(classes[seg]) * R
        # whole groups whose reads stay inside (16 words and a window of raw bytes at most) and inside
        # the segment
        safe = 0
        if g < full:
            if tz:
                raw_left = 4 * raw.shape[0] - TZ_WINDOW - (at >> 3)
                safe = min(full - g, (words.shape[0] - p) // GROUP, max(0, raw_left // TZ_GROUP_BYTES + 1))
            else:
                raw_left = 4 * raw.shape[0] - window(k) - ((i * k) >> 3)  # (a group's raw bits: 2k bytes)
                safe = min(full - g, (words.shape[0] - p) // GROUP, max(0, raw_left // (2 * k) + 1))
        inside = min(safe, (seg_end - i) // GROUP)
        if inside > 0:
            if tz:
                p, at = _tz_run(xs, g, inside, table, base_lo, words, p, raw, out, precision, at)
            else:
                p = _vector_run(xs, g, inside, table, base_lo, words, p, raw, out, precision, sym0, M)
            g += inside
            continue
        m = min(GROUP, n - i)
        split = GROUP
        base_hi = base_lo
        if i + m > seg_end:  # (a group crosses at most one boundary: segments are 256 long at least)
            split = seg_end - i
            base_hi = np.int64(classes[seg + 1]) * R
        lane0 = (g & 3) * GROUP
        if tz:
            if safe > 0:
                packed = _group_tz(xs, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, at)
                p, at = packed & 0xFFFFFFFF, packed >> 32
            else:
                p, at, err = _tz_elements(xs, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, m,
                                          precision, at, True)
                if err != OK:
                    return err
        elif safe > 0:
            if M == 7:
                p = _group_bf16(xs, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0)
            elif M == 10:
                p = _group_fp16(xs, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0)
            else:
                p = _group_fp32(xs, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, precision, sym0)
        else:
            p, err = _group_elements(xs, lane0, table, base_lo, base_hi, split, words, p, raw, out, i, m, precision,
                                     sym0, M, True)
            if err != OK:
                return err
        g += 1
    for lane in range(WIDE_LANES):
        if xs[lane] != WIDE_L:
            return ERR_BAD_END
    if p != words.shape[0]:
        return ERR_TRAILING
    if tz and tz_raw_left(raw, at):
        return ERR_TRAILING
    return OK


@inline
def _narrow_entries(syms, freqs, used):
    """(whether the decoding table of these tables (each class's used symbols, increasing, their
    frequencies and count, as :func:`._tans_kernels.class_tables_at` gives them) fits 4-byte
    entries (:data:`NARROW_FREQ`), the lowest symbol they use). Every class uses a symbol."""
    lowest = np.int64(syms[0, 0])
    highest = lowest
    most = np.int64(0)
    for c in range(used.shape[0]):
        lowest = min(lowest, np.int64(syms[c, 0]))
        highest = max(highest, np.int64(syms[c, used[c] - 1]))
        for u in range(used[c]):
            most = max(most, np.int64(freqs[c, u]))
    return highest - lowest < 1 << NARROW_DISTANCE_AT and most <= NARROW_FREQ, lowest


@inline
def _fill_table(syms, freqs, used, precision, M, sym0, table):
    """The decoder's table (``table``: classes x 2**precision entries, flat): each slot's
    frequency, its distance from its symbol's start and the symbol. In 8-byte entries the symbol
    where a 16-bit float holds it (shifted up by M - TOP_BITS; a float32's is shifted by the step),
    in 4-byte entries (:data:`NARROW_FREQ`) less ``sym0``, the lowest symbol the tables use."""
    shift = _symbol_shifts(M)[0]
    R = np.int64(1) << precision
    for c in range(used.shape[0]):
        at = c * R
        for u in range(used[c]):
            f = np.int64(freqs[c, u])
            s = np.int64(syms[c, u])
            for j in range(f):
                if table.itemsize == 4:
                    table[at + j] = ((f - 1) << NARROW_FREQ_AT) | (j << NARROW_DISTANCE_AT) | (s - sym0)
                else:
                    table[at + j] = _U((f << 32) | (j << 16) | (s << shift))
            at += f


@kernel
def decode_wide_substream(data, n, seg_len, M, out, detail, tz):
    """Decode a whole low-bit mode 4 substream (``data``: its bytes, the mode byte first), or with
    ``tz`` a mode 5 one (float32), into ``out`` (n float bits, ``M`` mantissa bits); OK or an error
    code, with its details in ``detail`` (on success, detail[0]: the bytes of a decoding table entry,
    4 or 8). Every field is checked against the bytes before it is read or allocated. (Parsed in
    Python, field by field, with the table built from whole-alphabet arrays, a chunk's front took
    25-40 us, scratch.)"""
    size = data.shape[0]
    W = 32 if M == 23 else 16
    classes = np.zeros((n + seg_len - 1) // seg_len, dtype=np.uint8)
    alphabet = np.int64(1) << (W - 1 - M + TOP_BITS + (TZ_BITS if tz else 0))
    pos, klog, precision, syms, freqs, used = class_tables_at(data, 1, alphabet, 1, WIDE_MAX_BITS, classes, detail)
    if pos < 0:
        return ERR_WIDE_PRECISION if pos == ERR_PRECISION else pos
    if pos + 4 * WIDE_LANES > size:
        detail[0] = 6
        return ERR_SHORT
    states = np.empty(WIDE_LANES, dtype=np.uint32)
    for lane in range(WIDE_LANES):
        x = _u32_at(data, pos + 4 * lane)
        if x < WIDE_L:
            detail[0] = x
            return ERR_WIDE_STATE
        states[lane] = x
    pos += 4 * WIDE_LANES
    count, pos = counted_at(data, pos, 2, detail)
    if count < 0:
        return count
    words = data[pos:pos + 2 * count].view(np.uint16)
    pos += 2 * count
    if tz:
        nraw, short = tz_raw_words(size, pos, n)
    else:
        nraw = (n * (M - TOP_BITS + 1) + 31) >> 5
        short = pos + 4 * nraw > size
    status = raw_field_status(size, pos, nraw, short, detail)
    if status != OK:
        return status
    raw = data[pos:size].view(np.uint32)
    narrow, sym0 = _narrow_entries(syms, freqs, used)
    if narrow and not tz:
        table = np.empty(used.shape[0] << precision, dtype=np.uint32)
        _fill_table(syms, freqs, used, precision, M, sym0, table)
        detail[0] = 4
        return decode_wide(words, raw, states, seg_len, M, classes, precision, table, sym0, out, False)
    wide = np.empty(used.shape[0] << precision, dtype=np.uint64)
    _fill_table(syms, freqs, used, precision, M, sym0, wide)
    detail[0] = 8
    return decode_wide(words, raw, states, seg_len, M, classes, precision, wide, sym0, out, tz)


@inline
def _encode_run(xs, g, count, table, base, symbols, out, t, precision):
    """``count`` whole groups from group ``g`` down, all in one segment (of table row ``base``), by
    the vector step: the next ``t``. (Only the step per group, as in the decoder's runs: the
    segment's bookkeeping around every group had cost 0.13 ns per element, scratch.)"""
    for h in range(g, g - count, -1):
        t = _encode16(xs, (h & 3) * GROUP, table, base, base, 0, symbols, GROUP * h, out, t, precision)
    return t


@inline
def _wide_encode(symbols, seg_len, classes, precision, used_syms, sent, alphabet, out):
    """The rANS words of ``symbols`` into the end of ``out`` (u16; n + 2 GROUP words hold them
    all: a symbol pushes one word at most); (where they begin, or -1 where ``out`` is too short,
    the 64 final states). The groups go from the last to the first, each by the vector step (the
    last group, if short, one element at a time), their pushed words each before the last's, from
    the end of ``out`` down."""
    n = symbols.shape[0]
    K = sent.shape[0]
    # (per class and symbol: frequency | start << 16, the used symbols' only)
    table = np.zeros(K * alphabet, dtype=np.int32)
    for c in range(K):
        total = 0
        for u in range(used_syms.shape[0]):
            f = np.int64(sent[c, u])
            if f:
                table[c * alphabet + used_syms[u]] = f | (total << 16)
                total += f
    xs = np.full(WIDE_LANES, WIDE_L, dtype=np.uint32)
    t = out.shape[0]
    groups = (n + GROUP - 1) // GROUP
    seg = (n - 1) // seg_len if n else 0
    seg_lo = seg * seg_len
    gg = groups - 1
    while gg >= 0:
        i = GROUP * gg
        m = min(GROUP, n - i)
        while i + m - 1 < seg_lo:
            seg -= 1
            seg_lo -= seg_len
        base_hi = np.int64(classes[seg]) * alphabet
        if t < GROUP:
            return np.int64(-1), xs
        if m == GROUP and i >= seg_lo:
            count = min(gg - (seg_lo + GROUP - 1) // GROUP + 1, t // GROUP)
            t = _encode_run(xs, gg, count, table, base_hi, symbols, out, t, precision)
            gg -= count
            continue
        base_lo = base_hi
        split = 0
        if i < seg_lo:  # (a group crosses at most one boundary: segments are 256 long at least)
            split = seg_lo - i
            base_lo = np.int64(classes[seg - 1]) * alphabet
        lane0 = (gg & 3) * GROUP
        if m == GROUP:
            t = _encode16(xs, lane0, table, base_lo, base_hi, split, symbols, i, out, t, precision)
        else:
            t = _encode_checked(xs, lane0, table, base_lo, base_hi, split, symbols, i, m, out, t, precision)
        gg -= 1
    return t, xs


@kernel
def encode_wide_substream(words, seg_len, W, M, zeros, classes16, costs, wide, work, hint):
    """The whole substream of a chunk of bf16, fp16 or fp32 floats (``W``, ``M``: their bits and
    mantissa bits): low-bit mode 4 with ``wide`` where no segment has low bits zero in all its
    elements, else mode 0 or 1 by tANS (which drop those bits), from one split and one choice of
    tables (the two modes choose them alike). ``zeros`` and ``classes16`` as
    :func:`._tans_kernels.encode_tans_substream` takes them (16-bit floats: empty, found as they
    split). Large arrays are carved from ``work`` as that function carves them. ``hint`` (int64[1],
    kept with ``work``): the rANS words per element of the thread's last mode 4 chunk, in 1/2**16
    (0: none yet), for the room its substream's array keeps for them. Returns the substream: mode
    4's in an array of its own, modes 0 and 1's a view into ``work``."""
    alphabet = np.int64(1) << (W - 1 - M + TOP_BITS)
    n = words.shape[0]
    # (none for modes 0 and 1, typed as mode 4's)
    dest, coded, raw_into, coded_end = np.empty(0, np.uint8), np.empty(0, np.uint16), np.empty(0, np.uint32), 0
    if wide:
        room = _room_for_any(n)
        if hint[0] > 0:  # (the last chunk's rANS words per element, and an eighth more)
            room = min(room, ((n * hint[0]) >> 16) * 9 // 8 + 4 * GROUP)
        dest, coded, raw_into, coded_end = _wide_dest(n, (n + seg_len - 1) // seg_len, alphabet,
                                                      raw_words_most(n, M), room)
    zeros, classes16, symbols, raw, nraw, klog, precision, used_syms, sent, coded_bytes, at = split_and_choose(
        words, seg_len, W, M, zeros, classes16, costs, WIDE_MAX_BITS, work, raw_into)
    nseg = classes16.shape[0]
    for j in range(nseg):
        wide = wide and zeros[j] == 0
    if not wide or nseg == 0:
        return tans_substream(W, M, seg_len, zeros, classes16, symbols, raw, nraw, klog, precision, used_syms, sent,
                              coded_bytes, at, work)
    return _wide_substream(WIDE_BYTE, symbols, seg_len, classes16, klog, precision, used_syms, sent, alphabet, dest,
                           coded, coded_end, raw, nraw, hint)


@kernel
def encode_tz_wide_substream(words, seg_len, classes16, costs, work):
    """The whole substream of low-bit mode 5 of the float32 bits ``words``: mode 3's symbols and raw
    bits (:func:`._tans_kernels.tz_front`) on mode 4's 64 states. Arguments as
    :func:`._tans_kernels.encode_tz_substream`'s; the substream in an array of its own."""
    symbols, raw, nraw, klog, precision, used_syms, sent, rest = tz_front(words, seg_len, classes16, costs, work)
    n = words.shape[0]
    dest, coded, raw_into, coded_end = _wide_dest(n, classes16.shape[0], TZ_ALPHABET, nraw, _room_for_any(n))
    copy_bytes(raw_into, 0, raw, 0, 4 * nraw)
    return _wide_substream(TZ_WIDE_BYTE, symbols, seg_len, classes16, klog, precision, used_syms, sent, TZ_ALPHABET,
                           dest, coded, coded_end, raw_into, nraw, np.zeros(1, dtype=np.int64))


@helper
def _room_for_any(n):
    """The u16 words that hold the rANS words of any ``n`` symbols: a symbol pushes one word at
    most, and a group's store reaches GROUP words below its last."""
    return n + 2 * GROUP


@helper
def _fields_size(klog, nseg, table_bytes):
    """The bytes of a mode 4 or 5 substream before its rANS words: the mode byte, class count and
    precision, class nibbles, table size, tables, the 64 states and the words' count."""
    return 1 + 2 + (((nseg + 1) >> 1) if klog else 0) + 4 + table_bytes + 4 * WIDE_LANES + 4


@inline
def _wide_dest(n, nseg, alphabet, raw_words, room):
    """A mode 4 or 5 substream's own array, for ``n`` symbols in ``nseg`` segments, ``room`` u16
    words for their rANS words and at most ``raw_words`` raw words, and its parts: (the array; the
    rANS words' part, filled from its end down; the byte where it ends; the raw words from there
    on). The rANS words and the raw words go straight into the place they keep in the substream,
    and the fields before them after them: coded in work memory and copied out (into memory the
    previous encoding had freed), MiniLM's fp16 encoding at one thread took 50.3 ms instead of 46.4
    (scratch, medians of four runs)."""
    K = np.int64(1) << MAX_CLASSES_LOG2
    head = (_fields_size(1, nseg, table_bytes_most(K, K * alphabet)) + 7) & ~7
    end = head + 2 * ((room + 3) & ~3)
    dest = np.empty(end + 4 * raw_words, dtype=np.uint8)
    return dest, dest[head:end].view(np.uint16), dest[end:].view(np.uint32), end


@inline
def _wide_substream(mode_byte, symbols, seg_len, classes16, klog, precision, used_syms, sent, alphabet, dest, coded,
                    coded_end, raw, nraw, hint):
    """A mode 4 or 5 substream (``mode_byte`` first) of ``symbols`` with the chosen tables, in
    ``dest`` as :func:`_wide_dest` made it: the rANS words coded into ``coded``, the ``nraw`` raw
    words ``raw`` already after them; where ``coded`` is too short, in a new array with room for
    any. Returns the substream, a view of its array (the model's encoder keeps it as it is: a copy
    of each substream into a bytes object had taken 3 ms of MiniLM bf16's 71, scratch), and sets
    ``hint`` (as :func:`encode_wide_substream` takes it)."""
    n = symbols.shape[0]
    nseg = classes16.shape[0]
    classes, tables, table_bytes = classes_and_tables(classes16, klog, used_syms, sent)
    begin, xs = _wide_encode(symbols, seg_len, classes, precision, used_syms, sent, alphabet, coded)
    if begin < 0:
        dest, coded, raw_into, coded_end = _wide_dest(n, nseg, alphabet, nraw, _room_for_any(n))
        copy_bytes(raw_into, 0, raw, 0, 4 * nraw)
        begin, xs = _wide_encode(symbols, seg_len, classes, precision, used_syms, sent, alphabet, coded)
    hint[0] = ((coded.shape[0] - begin) << 16) // max(n, 1)
    start = coded_end - 2 * (coded.shape[0] - begin) - _fields_size(klog, nseg, table_bytes)
    dest[start] = mode_byte
    pos = put_class_tables(dest, start + 1, klog, precision, classes, tables, table_bytes)
    for lane in range(WIDE_LANES):
        pos = put_u32(dest, pos, xs[lane])
    # (the words little-endian as they are in memory: Numba runs on little-endian machines only)
    put_u32(dest, pos, coded.shape[0] - begin)
    return dest[start:coded_end + 4 * nraw]
