"""Vector steps of the float coder's kernels, built as LLVM IR (private: the kernels call them).

Numba does not vectorise a loop whose iterations share a position in a bit stream or a word
stream, which is every loop of an entropy coder. The steps here take sixteen floats at a time in
vector registers, with the instructions the scalar loops cannot reach (gathers, expanding loads,
compresses, byte permutes). :data:`VECTOR_LEVEL` says which instructions the processor the kernels
are compiled for has: AVX-512 with VBMI and VBMI2, where each of those is one instruction, or AVX2,
where a step takes two halves of eight lanes, a table lookup is a load per lane by a key read as a
scalar, and the expanding load and the compress are a permute of eight lanes by a table of 256
rows. Every step has a scalar twin in its kernel module that writes the same bytes (the tests run
every tier).
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .._jit import host_features, inline

GROUP = 16  # elements a vector step takes

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


class Step:
    """What the vector steps build their IR from: vectors of GROUP lanes, the arrays' data, the
    group's states and the gather of its table entries."""

    def __init__(self, context, builder, signature, args):
        self.context, self.b, self.types, self.args = context, builder, signature.args, args

    @staticmethod
    def vec(t, n=GROUP):
        return ir.VectorType(t, n)

    def const(self, t, values):
        values = list(values)
        return ir.Constant(self.vec(t, len(values)), values)

    def splat(self, value, t):
        v = self.b.insert_element(ir.Constant(self.vec(t), ir.Undefined), value, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(self.vec(t), ir.Undefined), self.const(I32, [0] * GROUP))

    def intrinsic(self, name, ret, args):
        try:
            return self.b.module.get_global(name)
        except KeyError:
            return ir.Function(self.b.module, ir.FunctionType(ret, args), name=name)

    def at(self, k, index, t, n=GROUP):
        """A pointer to ``n`` elements of type ``t`` from ``index`` of array argument ``k``."""
        data = self.context.make_array(self.types[k])(self.context, self.b, self.args[k]).data
        return self.b.bitcast(self.b.gep(self.b.bitcast(data, t.as_pointer()), [index]), self.vec(t, n).as_pointer())

    def half(self, vector, h, n=GROUP // 2):
        """Lanes ``h * n`` to ``h * n + n - 1`` of ``vector``."""
        return self.b.shuffle_vector(vector, vector, self.const(I32, range(h * n, h * n + n)))

    def joined(self, parts):
        """The vectors ``parts`` (of equal lengths, a power of two of them) one after another."""
        while len(parts) > 1:
            n = 2 * parts[0].type.count
            parts = [self.b.shuffle_vector(parts[j], parts[j + 1], self.const(I32, range(n)))
                     for j in range(0, len(parts), 2)]
        return parts[0]

    def table(self, name, rows):
        """A constant table of the module (rows of eight bytes, one i64 each), made once."""
        try:
            return self.b.module.get_global(name)
        except KeyError:
            kind = ir.ArrayType(I64, len(rows))
            table = ir.GlobalVariable(self.b.module, kind, name=name)
            table.initializer = ir.Constant(kind, [int.from_bytes(bytes(r), "little") for r in rows])
            table.global_constant = True
            table.linkage = "internal"
            return table

    def permute8(self, vector, lanes, name, rows):
        """``vector`` (eight i32 lanes) permuted by the row of the table ``rows`` (256 rows of eight
        lane indices) that the eight i1 ``lanes`` number: AVX2's stand-in for a compress or an
        expand."""
        b = self.b
        row = b.load(b.gep(self.table(name, rows), [ir.Constant(I32, 0), b.zext(b.bitcast(lanes, I8), I32)]), align=8)
        index = b.zext(b.bitcast(row, self.vec(I8, 8)), self.vec(I32, 8))
        permd = self.intrinsic("llvm.x86.avx2.permd", self.vec(I32, 8), [self.vec(I32, 8), self.vec(I32, 8)])
        return b.call(permd, [vector, index])

    def expanded_words(self, k, p, need):
        """The next 16-bit words of array argument ``k`` from ``p``, one to each lane set in
        ``need`` in lane order (zero-extended to i32; the other lanes undefined): (those lanes, the
        index after the words taken). AVX-512 takes sixteen lanes by an expanding load; AVX2 eight,
        a load of eight words permuted by a table row: sixteen words or eight from ``p`` at most,
        as the expanding load may read."""
        b = self.b
        if VECTOR_LEVEL == "avx512":
            expand = self.intrinsic("llvm.masked.expandload.v16i16", self.vec(I16),
                                    [I16.as_pointer(), self.vec(I1), self.vec(I16)])
            w = b.call(expand, [b.bitcast(self.at(k, p, I16), I16.as_pointer()), need,
                                ir.Constant(self.vec(I16), None)])
            w = b.zext(w, self.vec(I32))
        else:
            words = b.zext(b.load(self.at(k, p, I16, 8), align=2), self.vec(I32, 8))
            w = self.permute8(words, need, "deepcabac_expand8", EXPAND_ROWS)
        return w, b.add(p, self.count(need))

    def stored_before(self, k, t, values, push):
        """Store the low 16 bits of the lanes of ``values`` set in ``push``, in lane order, just
        before index ``t`` of array argument ``k`` (a uint16 array), in stores that reach no lower
        than ``t - 16`` (the lanes below the words are left for the next group to overwrite):
        their count, an int64. (AVX-512 compresses in a register and rotates the words to the top
        lanes: the compressing store to memory took 3.6 ns per element, a masked store of the low
        lanes 0.3 more than this, scratch; AVX2 compresses each half to its top lanes by a table.)"""
        b = self.b
        if VECTOR_LEVEL == "avx512":
            count = self.count(push)
            compress = self.intrinsic("llvm.x86.avx512.mask.compress.v16i16", self.vec(I16),
                                      [self.vec(I16), self.vec(I16), self.vec(I1)])
            words = b.call(compress, [b.trunc(values, self.vec(I16)), ir.Constant(self.vec(I16), None), push])
            permute = self.intrinsic("llvm.x86.avx512.permvar.hi.256", self.vec(I16), [self.vec(I16), self.vec(I16)])
            words = b.call(permute, [words, b.add(self.const(I16, range(GROUP)), self.splat(b.trunc(count, I16), I16))])
            b.store(words, self.at(k, b.sub(t, ir.Constant(I64, GROUP)), I16), align=2)
            return count
        end = t
        for h in (1, 0):  # (the count of each half's own mask: sixteen lanes' took a pack of six instructions)
            half = self.half(push, h)
            words = self.permute8(self.half(values, h), half, "deepcabac_compress8_top", COMPRESS_TOP_ROWS)
            b.store(b.trunc(words, self.vec(I16, 8)), self.at(k, b.sub(t, ir.Constant(I64, 8)), I16, 8), align=2)
            t = b.sub(t, self.count(half))
        return b.sub(end, t)

    def lookup16(self, values, index):
        """Lane j of the constant ``values`` (sixteen int32) for each lane's ``index`` (0 to 15):
        one permute with AVX-512, two of eight and a select with AVX2."""
        b = self.b
        if VECTOR_LEVEL == "avx512":
            permute = self.intrinsic("llvm.x86.avx512.permvar.si.512", self.vec(I32), [self.vec(I32), self.vec(I32)])
            return b.call(permute, [self.const(I32, values), index])
        permd = self.intrinsic("llvm.x86.avx2.permd", self.vec(I32, 8), [self.vec(I32, 8), self.vec(I32, 8)])
        low, high = ([b.call(permd, [self.const(I32, values[h:h + 8]), self.half(index, j)]) for j in range(2)]
                     for h in (0, 8))
        return b.select(b.icmp_unsigned(">", index, self.const(I32, [7] * GROUP)), self.joined(high), self.joined(low))

    def words_at(self, k, at, first):
        """Each lane's four bytes of array argument ``k`` from byte ``at + first`` (``first``: an
        int32 per lane, below 61): the lanes of one 64-byte window, picked by a byte permute with
        AVX-512, loaded one by one with AVX2."""
        b = self.b
        data = b.bitcast(self.at(k, at, I8), I8.as_pointer())
        if VECTOR_LEVEL == "avx512":
            pick = b.add(b.mul(first, self.const(I32, [0x01010101] * GROUP)), self.const(I32, [0x03020100] * GROUP))
            window = b.load(b.bitcast(data, self.vec(I8, 64).as_pointer()), align=1)
            permute = self.intrinsic("llvm.x86.avx512.permvar.qi.512", self.vec(I8, 64),
                                     [self.vec(I8, 64), self.vec(I8, 64)])
            return b.bitcast(b.call(permute, [window, b.bitcast(pick, self.vec(I8, 64))]), self.vec(I32))
        out = ir.Constant(self.vec(I32), ir.Undefined)
        for lane in range(GROUP):
            at = b.gep(data, [b.zext(b.extract_element(first, ir.Constant(I32, lane)), I64)])
            out = b.insert_element(out, b.load(b.bitcast(at, I32.as_pointer()), align=1), ir.Constant(I32, lane))
        return out

    def below(self, n):
        """The mask of the lanes below ``n`` (an int64)."""
        return self.b.icmp_signed("<", self.const(I64, range(GROUP)), self.splat(n, I64))

    def lanes(self, lo, hi, split, t):
        """``lo`` (a scalar of type ``t``) in the lanes below ``split``, ``hi`` in the others."""
        return self.b.select(self.below(split), self.splat(lo, t), self.splat(hi, t))

    def lookup(self, k, keys, mask, lo, hi, split, halves=False):
        """The entries of the table, array argument ``k``, at row ``lo`` (the lanes below ``split``)
        or ``hi``, plus each lane's key: the GROUP unsigned integers at the pointer ``keys`` (the
        states as stored, or the symbols), less their bits from ``mask`` (an i32, or None) up. With
        ``halves`` the entries are 8 bytes: (their low halves, their high halves). AVX-512 gathers
        by 32-bit indices (a gather of sixteen 64-bit addresses and lane-by-lane narrowing took a
        dozen more instructions), two gathers and two permutes for 8-byte entries. AVX2 reads each
        key as a scalar and loads its entry (a load per 4 bytes): extracting the keys from a
        vector register instead made a decode step 15% slower on Zen 3, and its gather instruction
        had taken as long as the loads by extracted keys (scratch)."""
        b = self.b
        data = self.context.make_array(self.types[k])(self.context, b, self.args[k]).data
        width = keys.type.pointee
        if VECTOR_LEVEL != "avx512":
            words = b.bitcast(data, I32.as_pointer())
            parts = [ir.Constant(self.vec(I32), ir.Undefined) for _ in range(2 if halves else 1)]
            for lane in range(GROUP):
                key = b.load(b.gep(keys, [ir.Constant(I32, lane)]), align=width.width // 8)
                key = b.zext(b.and_(key, mask) if mask is not None else key, I64)
                at = b.add(b.select(b.icmp_signed("<", ir.Constant(I64, lane), split), lo, hi), key)
                at = b.shl(at, ir.Constant(I64, 1)) if halves else at
                for h, part in enumerate(parts):
                    entry = b.load(b.gep(words, [b.add(at, ir.Constant(I64, h))] if h else [at]), align=4)
                    parts[h] = b.insert_element(part, entry, ir.Constant(I32, lane))
            return tuple(parts) if halves else parts[0]
        index = b.load(b.bitcast(keys, self.vec(width).as_pointer()), align=width.width // 8)
        index = b.zext(index, self.vec(I32)) if width.width < 32 else index
        index = b.and_(index, self.splat(mask, I32)) if mask is not None else index
        index = b.add(self.lanes(b.trunc(lo, I32), b.trunc(hi, I32), split, I32), index)
        data = b.bitcast(data, I8.as_pointer())
        if not halves:
            gather = self.intrinsic("llvm.x86.avx512.mask.gather.dpi.512", self.vec(I32),
                                    [self.vec(I32), I8.as_pointer(), self.vec(I32), self.vec(I1), I32])
            return b.call(gather, [ir.Constant(self.vec(I32), None), data, index, self.const(I1, [1] * GROUP),
                                   ir.Constant(I32, 4)])
        gather = self.intrinsic("llvm.x86.avx512.mask.gather.dpq.512", self.vec(I64, 8),
                                [self.vec(I64, 8), I8.as_pointer(), self.vec(I32, 8), self.vec(I1, 8), I32])
        parts = [b.bitcast(b.call(gather, [ir.Constant(self.vec(I64, 8), None), data, self.half(index, h),
                                           self.const(I1, [1] * 8), ir.Constant(I32, 8)]), self.vec(I32))
                 for h in range(2)]
        return (b.shuffle_vector(parts[0], parts[1], self.const(I32, range(0, 2 * GROUP, 2))),
                b.shuffle_vector(parts[0], parts[1], self.const(I32, range(1, 2 * GROUP, 2))))

    def count(self, mask):
        """The lanes set in ``mask`` (of 8 or 16 lanes), as an int64."""
        bits = ir.IntType(mask.type.count)
        popcount = self.intrinsic(f"llvm.ctpop.i{bits.width}", bits, [bits])
        return self.b.zext(self.b.call(popcount, [self.b.bitcast(mask, bits)]), I64)


def _vector_level() -> str | None:
    """The vector steps' instructions on the processor the kernels are compiled for: "avx512"
    (AVX-512 F, BW, VL, VBMI and VBMI2: the expanding load, register compress and byte permutes
    are single instructions), "avx2" (permutes of eight 32-bit lanes and a load per lane for a
    gather), or None: with neither, with a Numba cache for another processor, or with
    DEEPCABAC_SCALAR_STEPS=1, the kernels go one element at a time: the same bytes, slower.
    DEEPCABAC_AVX2_STEPS=1 takes the AVX2 steps on an AVX-512 processor (the tests run every tier
    the processor has)."""
    have = host_features()
    avx512 = {"+avx512f", "+avx512bw", "+avx512vl", "+avx512vbmi", "+avx512vbmi2"} <= have
    if avx512 and os.environ.get("DEEPCABAC_AVX2_STEPS") != "1":
        return "avx512"
    if {"+avx2", "+popcnt"} <= have:
        return "avx2"
    return None


VECTOR_LEVEL = _vector_level()
VECTOR_STEPS = VECTOR_LEVEL is not None


def _expand_rows():
    """Row m: for each of eight lanes, the rank of its bit among those set in m (an expanding
    load's word for it); 0 for a lane whose bit is clear."""
    return [[bin(m & ((1 << lane) - 1)).count("1") if m >> lane & 1 else 0 for lane in range(8)] for m in range(256)]


def _compress_top_rows():
    """Row m: for each of eight lanes, the lane whose bit set in m a compress to the top lanes
    puts there (the last lane set to lane 7, the one before to lane 6, ...); 0 below those."""
    rows = []
    for m in range(256):
        taken = [lane for lane in range(8) if m >> lane & 1]
        rows.append([0] * (8 - len(taken)) + taken)
    return rows


EXPAND_ROWS = _expand_rows()
COMPRESS_TOP_ROWS = _compress_top_rows()


@inline
def window(k):
    """The bytes a vector step loads or stores for sixteen fields of ``k`` bits: 32, or 64 past 15
    bits (the group's 2 k bytes and the bytes of the lane holding its last field)."""
    return 32 if k <= 15 else 64


def fields(k):
    """Sixteen fields of ``k`` bits one after another, field ``lane`` from bit ``k * lane``: each
    one's first byte and its first bit in that byte."""
    return [(k * lane) >> 3 for lane in range(GROUP)], [(k * lane) & 7 for lane in range(GROUP)]


def _residues(k):
    """Fields of ``k`` bits as :func:`fields` lays them (each inside one 32-bit lane after a shift
    of its first bit): how many residues mod R keep every byte to one field of each residue."""
    first, _ = fields(k)
    last = [(k * lane + k - 1) >> 3 for lane in range(GROUP)]
    for R in range(1, GROUP + 1):
        if all(first[lane + R] > last[lane] for lane in range(GROUP - R)):
            return R, first, last
    raise ValueError(f"fields of {k} bits")


def split_step(W, shift):
    """The split of sixteen floats of ``W`` (16 or 32) bits dropping no low bit: arguments (words,
    i, symbols, raw, at): each element's symbol (its bits from ``shift`` up, less the sign) to
    ``symbols[i:i + 16]`` (uint16), its raw bits (``k = shift + 1``: the mantissa bits below
    ``shift``, the sign on top) packed after one another from byte ``at`` of ``raw`` (a uint32
    array), element i's from bit ``k * (i % 16)`` of the group's ``2 k`` bytes. Stores
    :func:`window` bytes: those after the group's are zero, for the next group to overwrite; they
    must lie inside ``raw``."""
    k = shift + 1
    if not (6 <= k <= 9 if W == 16 else W == 32 and 17 <= k <= 25):
        raise ValueError(f"raw fields of {k} bits in {W}-bit floats")  # (each inside one 32-bit lane)
    size = window.py_func(k)
    R, first, last = _residues(k)
    # each byte of the group's raw bits from the lane of each residue whose field covers it
    picks = []
    for residue in range(R):
        pick = []
        for byte in range(size):
            lanes = [lane for lane in range(residue, GROUP, R) if first[lane] <= byte <= last[lane]]
            pick.append(4 * lanes[0] + byte - first[lanes[0]] if lanes else 64)
        picks.append(pick)
    It = I16 if W == 16 else I32

    @intrinsic
    def step(typingctx, words, i, symbols, raw, at):
        def codegen(context, builder, signature, args):
            v = Step(context, builder, signature, args)
            b = builder
            _, i_, _, _, at_ = args
            w = b.load(v.at(0, i_, It), align=W // 8)
            symbol = b.and_(b.lshr(w, v.const(It, [shift] * GROUP)),
                            v.const(It, [(1 << (W - 1 - shift)) - 1] * GROUP))
            b.store(b.trunc(symbol, v.vec(I16)) if W == 32 else symbol, v.at(2, i_, I16), align=2)
            r = b.or_(b.shl(b.lshr(w, v.const(It, [W - 1] * GROUP)), v.const(It, [shift] * GROUP)),
                      b.and_(w, v.const(It, [(1 << shift) - 1] * GROUP)))
            r = b.zext(r, v.vec(I32)) if W == 16 else r
            placed = b.shl(r, v.const(I32, fields(k)[1]))
            bytes64 = b.bitcast(placed, v.vec(I8, 64))
            zero = ir.Constant(v.vec(I8, 64), None)
            packed = None
            for pick in picks:
                part = b.shuffle_vector(bytes64, zero, v.const(I32, pick))
                packed = part if packed is None else b.or_(packed, part)
            b.store(packed, b.bitcast(v.at(3, at_, I8), v.vec(I8, size).as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(words, i, symbols, raw, at), codegen

    return step
