"""Vector steps of the float coder's kernels, built as LLVM IR (private: the kernels call them).

Numba does not vectorise a loop whose iterations share a position in a bit stream or a word
stream, which is every loop of an entropy coder. The steps here take sixteen floats at a time in
AVX-512 registers, with the instructions the scalar loops cannot reach (gathers, expanding
loads, compresses, byte permutes); :data:`VECTOR_STEPS` says whether the processor the kernels are
compiled for has them. Every step has a scalar twin in its kernel module that writes the same
bytes (the tests run both).
"""

from __future__ import annotations

import os

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .._jit import inline

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

    def at(self, k, index, t):
        """A pointer to GROUP elements of type ``t`` from ``index`` of array argument ``k``."""
        data = self.context.make_array(self.types[k])(self.context, self.b, self.args[k]).data
        return self.b.bitcast(self.b.gep(self.b.bitcast(data, t.as_pointer()), [index]), self.vec(t).as_pointer())

    def below(self, n):
        """The mask of the lanes below ``n`` (an int64)."""
        return self.b.icmp_signed("<", self.const(I64, range(GROUP)), self.splat(n, I64))

    def lanes(self, lo, hi, split, t):
        """``lo`` (a scalar of type ``t``) in the lanes below ``split``, ``hi`` in the others."""
        return self.b.select(self.below(split), self.splat(lo, t), self.splat(hi, t))

    def gather32(self, k, index):
        """The 4-byte elements of array argument ``k`` at the lanes' int32 ``index``: one gather of
        32-bit indices (LLVM's generic gather takes 64-bit addresses, twice the instructions)."""
        b = self.b
        data = self.context.make_array(self.types[k])(self.context, b, self.args[k]).data
        gather = self.intrinsic("llvm.x86.avx512.mask.gather.dpi.512", self.vec(I32),
                                [self.vec(I32), I8.as_pointer(), self.vec(I32), self.vec(I1), I32])
        return b.call(gather, [ir.Constant(self.vec(I32), None), b.bitcast(data, I8.as_pointer()), index,
                               self.const(I1, [1] * GROUP), ir.Constant(I32, 4)])

    def rows(self, lo, hi, split, slot):
        """The table (argument 2, 8-byte entries) at int32 ``slot`` of row ``lo`` for the lanes below
        ``split``, of row ``hi`` for the others: (the entries' low halves, their high halves), from
        two gathers of eight by 32-bit indices, parted by two permutes (a gather of sixteen 64-bit
        addresses and lane-by-lane narrowing took a dozen more instructions)."""
        b = self.b
        index = b.add(self.lanes(b.trunc(lo, I32), b.trunc(hi, I32), split, I32), slot)
        data = self.context.make_array(self.types[2])(self.context, b, self.args[2]).data
        gather = self.intrinsic("llvm.x86.avx512.mask.gather.dpq.512", self.vec(I64, 8),
                                [self.vec(I64, 8), I8.as_pointer(), self.vec(I32, 8), self.vec(I1, 8), I32])
        parts = [b.bitcast(b.call(gather, [ir.Constant(self.vec(I64, 8), None), b.bitcast(data, I8.as_pointer()),
                                           b.shuffle_vector(index, index, self.const(I32, range(h, h + 8))),
                                           self.const(I1, [1] * 8), ir.Constant(I32, 8)]), self.vec(I32))
                 for h in (0, GROUP // 2)]
        return (b.shuffle_vector(parts[0], parts[1], self.const(I32, range(0, 2 * GROUP, 2))),
                b.shuffle_vector(parts[0], parts[1], self.const(I32, range(1, 2 * GROUP, 2))))

    def count(self, mask):
        """The lanes set in ``mask``, as an int64."""
        popcount = self.intrinsic("llvm.ctpop.i16", I16, [I16])
        return self.b.zext(self.b.call(popcount, [self.b.bitcast(mask, I16)]), I64)


def _vector_steps() -> bool:
    """Whether the kernels are compiled for a processor with AVX-512's 16-bit compress and expand
    (VBMI2, with BW and VL) and byte permutes (VBMI): the steps' expanding load, register compress
    and byte shuffles need them to be single instructions (elsewhere LLVM would load lane by lane,
    or not compile the compress at all). Else, or with DEEPCABAC_SCALAR_STEPS=1 (the tests run
    both), the kernels go one element at a time: the same bytes, slower."""
    if numba.config.DISABLE_JIT or os.environ.get("DEEPCABAC_SCALAR_STEPS") == "1":
        return False
    if numba.config.CPU_NAME not in (None, "host"):
        return False  # (a portable cache for another processor: no vector instruction assumed)
    features = numba.config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    have = set(features.split(","))
    return {"+avx512f", "+avx512bw", "+avx512vl", "+avx512vbmi", "+avx512vbmi2"} <= have


VECTOR_STEPS = _vector_steps()


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
