"""Numba kernels behind :mod:`deepcabac_py.matrix.formats` (private: flat arrays and integers only).

Layout shared by CER and CSER (see ``matrix_formats`` for the full description):

* ``values``  float32 or int32 [K]: the distinct values ranked by frequency; ``values[0]`` (the most
  frequent, usually 0) is implicit and never stored per element.
* ``tok``     the column tokens of every row, row after row, and inside a row group after group
  (one group per value), each group's columns ascending. Absolute coding: one column index per
  element (uint8/16/32). Delta coding: the gap to the previous column of the same group (the first
  column counts from -1), a token of all ones (ESC) meaning "skip ESC columns, no element" (a real
  element always follows an escape inside its group); one byte per token (delta8, ESC 255) or one
  nibble (delta4, ESC 15; two per byte, low nibble first; every group starts on a byte, so a group
  with an odd number of nibbles leaves the high nibble of its last byte unused). The array is
  padded with ``PAD_TOKENS`` zero bytes so that kernels may read a few tokens past a group.
* ``gcnt``    tokens per group (nibbles for delta4); ``rowng`` groups per row; ``gval`` (CSER only)
  the rank of each group's value. CER has no ``gval``: group i of a row holds rank i + 1 (empty
  groups allowed).
* ``"entries"`` coding (rows of tiny groups): no groups at all. ``tok`` holds every entry's
  absolute column, ascending along the row, ``gval`` its rank or level code (CER too), ``rowng``
  the entries per row; ``gcnt`` is empty and ``blk_grp`` equals ``blk_tok``.
* ``blk_tok`` / ``blk_grp`` (uint32 [nblk + 1]): offsets into ``tok`` and the group arrays of every
  block of ``ROWS_PER_BLOCK`` rows, the only absolute pointers; rows inside a block are walked in order.

CER kernels are the CSER kernels called with ``gval=None`` (Numba compiles the ``gval is None``
branch away). Every kernel works on a range of row blocks ``[b0, b1)``; the ``*_par`` drivers split
the blocks into ``nchunks`` ranges of about equal token counts and run them with ``prange`` (the
entries matvec splits at rows, at cuts worked out once per matrix).

Dot products follow the distributive law: the inputs of a group are added (four partial sums; in
matmat, four rows of X at a time), then multiplied once by the group's value. ``_mv_abs_flat`` is the
exception for rows of many small groups (dozens of groups of four to nine entries: finely quantized
unpruned layers): it writes each group's value once per entry into a scratch row and runs one
multiply-add loop over the row, up to twice as fast there as a short loop per group. Where groups
are tinier still (many distinct values, few entries per row), the "entries" coding drops groups
altogether and ``_mv_entries`` looks each entry's value up by rank, or reads it from the entry's
level code.
All sums are float32 in a fixed order, so results do not depend on the number of threads.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .._jit import inline, kernel, parallel_kernel

ROWS_PER_BLOCK = 16
PAD_TOKENS = 4

CODING_ABSOLUTE = 0
CODING_DELTA8 = 1
CODING_DELTA4 = 2
CODING_ENTRIES = 3
ESC8 = 255
ESC4 = 15
# Indices are cast to unsigned where they are used: Numba adds a negative-index wraparound to every
# signed index, which costs more than the load itself in these loops.
U = np.uint64


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


@kernel
def _chunk_bound(blk_tok, c, nchunks):
    """First block of chunk ``c``: the smallest block whose token offset reaches c/nchunks of all."""
    nblk = blk_tok.shape[0] - 1
    if c >= nchunks:
        return nblk
    target = np.int64(blk_tok[nblk]) * c // nchunks
    lo = 0
    hi = nblk
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(blk_tok[mid]) < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------------------------------
# matvec
# --------------------------------------------------------------------------------------------------


@kernel
def _mv_abs(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y):
    m = y.shape[0]
    v0 = values[0]
    base = np.float32(v0 * xsum) if v0 != 0 else np.float32(0.0)
    zero = np.float32(0.0)
    t = np.int64(blk_tok[b0])
    g = np.int64(blk_grp[b0])
    for r in range(b0 * ROWS_PER_BLOCK, min(m, b1 * ROWS_PER_BLOCK)):
        acc = zero
        ng = np.int64(rowng[U(r)])
        for i in range(ng):
            e = t + np.int64(gcnt[U(g)])
            s0 = zero
            s1 = zero
            s2 = zero
            s3 = zero
            while t + 4 <= e:
                s0 += x[tok[U(t)]]
                s1 += x[tok[U(t + 1)]]
                s2 += x[tok[U(t + 2)]]
                s3 += x[tok[U(t + 3)]]
                t += 4
            # 0..3 tokens left: read three (the array is padded), keep the ones inside the group.
            rem = e - t
            a = x[tok[U(t)]]
            b = x[tok[U(t + 1)]]
            c = x[tok[U(t + 2)]]
            s0 += a if rem > 0 else zero
            s1 += b if rem > 1 else zero
            s2 += c if rem > 2 else zero
            t = e
            if gval is None:
                rank = i + 1
            else:
                rank = np.int64(gval[U(g)])
            acc += (values[U(rank)] - v0) * ((s0 + s1) + (s2 + s3))
            g += 1
        y[r] = base + acc


@kernel
def _mv_abs_flat(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y):
    m = y.shape[0]
    v0 = values[0]
    base = np.float32(v0 * xsum) if v0 != 0 else np.float32(0.0)
    zero = np.float32(0.0)
    # coef[k] = the value (minus v0) of the k-th entry of the current row; four slots are written per
    # group whatever its size (later groups overwrite the excess), more only for larger groups.
    coef = np.zeros(x.shape[0] + 4, dtype=np.float32)
    t = np.int64(blk_tok[b0])
    g = np.int64(blk_grp[b0])
    for r in range(b0 * ROWS_PER_BLOCK, min(m, b1 * ROWS_PER_BLOCK)):
        ng = np.int64(rowng[U(r)])
        pos = np.int64(0)
        for i in range(ng):
            c = np.int64(gcnt[U(g)])
            if gval is None:
                rank = i + 1
            else:
                rank = np.int64(gval[U(g)])
            cf = values[U(rank)] - v0
            coef[U(pos)] = cf
            coef[U(pos + 1)] = cf
            coef[U(pos + 2)] = cf
            coef[U(pos + 3)] = cf
            j = np.int64(4)
            while j < c:
                coef[U(pos + j)] = cf
                coef[U(pos + j + 1)] = cf
                coef[U(pos + j + 2)] = cf
                coef[U(pos + j + 3)] = cf
                j += 4
            pos += c
            g += 1
        a0 = zero
        a1 = zero
        a2 = zero
        a3 = zero
        k = np.int64(0)
        while k + 4 <= pos:
            a0 += coef[U(k)] * x[tok[U(t + k)]]
            a1 += coef[U(k + 1)] * x[tok[U(t + k + 1)]]
            a2 += coef[U(k + 2)] * x[tok[U(t + k + 2)]]
            a3 += coef[U(k + 3)] * x[tok[U(t + k + 3)]]
            k += 4
        rem = pos - k
        p = coef[U(k)] * x[tok[U(t + k)]]
        q = coef[U(k + 1)] * x[tok[U(t + k + 1)]]
        u = coef[U(k + 2)] * x[tok[U(t + k + 2)]]
        a0 += p if rem > 0 else zero
        a1 += q if rem > 1 else zero
        a2 += u if rem > 2 else zero
        t += pos
        y[r] = base + ((a0 + a1) + (a2 + a3))


@kernel
def _mv_d8(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y):
    m = y.shape[0]
    nm1 = x.shape[0] - 1
    v0 = values[0]
    base = np.float32(v0 * xsum) if v0 != 0 else np.float32(0.0)
    zero = np.float32(0.0)
    t = np.int64(blk_tok[b0])
    g = np.int64(blk_grp[b0])
    for r in range(b0 * ROWS_PER_BLOCK, min(m, b1 * ROWS_PER_BLOCK)):
        acc = zero
        ng = np.int64(rowng[U(r)])
        for i in range(ng):
            cnt = np.int64(gcnt[U(g)])
            e = t + cnt
            p = np.int64(-1)
            s0 = zero
            s1 = zero
            s2 = zero
            s3 = zero
            while t + 4 <= e:
                # Byte gaps rarely reach ESC: test four tokens at once (d + 1 == 256 sets bit 8).
                i0 = np.int64(tok[U(t)]) + 1
                i1 = np.int64(tok[U(t + 1)]) + 1
                i2 = np.int64(tok[U(t + 2)]) + 1
                i3 = np.int64(tok[U(t + 3)]) + 1
                if ((i0 | i1 | i2 | i3) & 256) == 0:
                    p0 = p + i0
                    p1 = p0 + i1
                    p2 = p1 + i2
                    p = p2 + i3
                    s0 += x[U(p0)]
                    s1 += x[U(p1)]
                    s2 += x[U(p2)]
                    s3 += x[U(p)]
                else:
                    # An escape moves p by ESC and adds nothing. A real element follows every
                    # escape inside a group, so p stays a valid column and x[p] may be read.
                    for q in range(4):
                        d = np.int64(tok[U(t + q)])
                        p += d + (d != ESC8)
                        v = x[U(p)]
                        s0 += v if d != ESC8 else zero
                t += 4
            # 0..3 tokens left: read three (tokens past the group belong to the next group or the
            # padding, so p is clamped before use), keep the ones inside the group.
            rem = e - t
            d0 = np.int64(tok[U(t)])
            d1 = np.int64(tok[U(t + 1)])
            d2 = np.int64(tok[U(t + 2)])
            p0 = p + d0 + (d0 != ESC8)
            p1 = p0 + d1 + (d1 != ESC8)
            p2 = p1 + d2 + (d2 != ESC8)
            v0_ = x[U(min(p0, nm1))]
            v1_ = x[U(min(p1, nm1))]
            v2_ = x[U(min(p2, nm1))]
            s0 += v0_ if (rem > 0) & (d0 != ESC8) else zero
            s1 += v1_ if (rem > 1) & (d1 != ESC8) else zero
            s2 += v2_ if (rem > 2) & (d2 != ESC8) else zero
            t = e
            if gval is None:
                rank = i + 1
            else:
                rank = np.int64(gval[U(g)])
            acc += (values[U(rank)] - v0) * ((s0 + s1) + (s2 + s3))
            g += 1
        y[r] = base + acc


@kernel
def _mv_d4(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y):
    # As _mv_d8 with nibble tokens: gcnt counts nibbles, a group takes (gcnt + 1) // 2 bytes.
    # Nibble gaps reach ESC often, so escapes are handled without a branch: an escape moves p by
    # ESC and adds nothing (a real element follows every escape inside a group, so x[p] is valid).
    m = y.shape[0]
    nm1 = x.shape[0] - 1
    v0 = values[0]
    base = np.float32(v0 * xsum) if v0 != 0 else np.float32(0.0)
    zero = np.float32(0.0)
    t = np.int64(blk_tok[b0])
    g = np.int64(blk_grp[b0])
    for r in range(b0 * ROWS_PER_BLOCK, min(m, b1 * ROWS_PER_BLOCK)):
        acc = zero
        ng = np.int64(rowng[U(r)])
        for i in range(ng):
            cnt = np.int64(gcnt[U(g)])
            e = t + ((cnt + 1) >> 1)
            p = np.int64(-1)
            s0 = zero
            s1 = zero
            s2 = zero
            s3 = zero
            for _ in range(cnt >> 2):
                w = np.int64(tok[U(t)]) | (np.int64(tok[U(t + 1)]) << 8)
                d0 = w & 15
                d1 = (w >> 4) & 15
                d2 = (w >> 8) & 15
                d3 = w >> 12
                p0 = p + d0 + (d0 != ESC4)
                p1 = p0 + d1 + (d1 != ESC4)
                p2 = p1 + d2 + (d2 != ESC4)
                p = p2 + d3 + (d3 != ESC4)
                v0_ = x[U(p0)]
                v1_ = x[U(p1)]
                v2_ = x[U(p2)]
                v3_ = x[U(p)]
                s0 += v0_ if d0 != ESC4 else zero
                s1 += v1_ if d1 != ESC4 else zero
                s2 += v2_ if d2 != ESC4 else zero
                s3 += v3_ if d3 != ESC4 else zero
                t += 2
            rem = cnt & 3
            w = np.int64(tok[U(t)]) | (np.int64(tok[U(t + 1)]) << 8)
            d0 = w & 15
            d1 = (w >> 4) & 15
            d2 = (w >> 8) & 15
            p0 = p + d0 + (d0 != ESC4)
            p1 = p0 + d1 + (d1 != ESC4)
            p2 = p1 + d2 + (d2 != ESC4)
            v0_ = x[U(min(p0, nm1))]
            v1_ = x[U(min(p1, nm1))]
            v2_ = x[U(min(p2, nm1))]
            s0 += v0_ if (rem > 0) & (d0 != ESC4) else zero
            s1 += v1_ if (rem > 1) & (d1 != ESC4) else zero
            s2 += v2_ if (rem > 2) & (d2 != ESC4) else zero
            t = e
            if gval is None:
                rank = i + 1
            else:
                rank = np.int64(gval[U(g)])
            acc += (values[U(rank)] - v0) * ((s0 + s1) + (s2 + s3))
            g += 1
        y[r] = base + acc


@inline
def _entry_coefficient(gval, offsets, t):
    # (``offsets is None`` is decided when the kernel is compiled, as ``gval is None`` elsewhere)
    if offsets is None:
        return np.float32(gval[U(t)])  # a level code read as int8
    return offsets[gval[U(t)]]


@kernel
def _mv_entries_rows(r0, r1, t, p, tok, rowng, gval, offsets, outliers, x, base, scale, y):
    # One multiply-add per entry: where groups hold one or two entries, the per-group work of the
    # other kernels costs more than the multiplications it saves. The coefficient is looked up by
    # rank in ``offsets`` (``values`` with v0 taken off every rank but 0, which holds v0 itself: no
    # entry has rank 0; a subtraction per entry saved, 3-9% of this loop), or, with ``offsets`` None,
    # read from the entry itself: ``gval`` holds int8 level codes (one dependent load less per entry,
    # 1.25x on 90%-pruned layers), times ``scale`` (the step) once per row, and the few codes that
    # stand for levels outside int8 are corrected from ``outliers`` ([position, level - int8(code)],
    # by position; empty for ranks). Row r gets ``base + scale * sum``.
    zero = np.float32(0.0)
    nout = outliers.shape[0]
    for r in range(r0, r1):
        e = t + np.int64(rowng[U(r)])
        a0 = zero
        a1 = zero
        a2 = zero
        a3 = zero
        while t + 4 <= e:
            a0 += _entry_coefficient(gval, offsets, t) * x[tok[U(t)]]
            a1 += _entry_coefficient(gval, offsets, t + 1) * x[tok[U(t + 1)]]
            a2 += _entry_coefficient(gval, offsets, t + 2) * x[tok[U(t + 2)]]
            a3 += _entry_coefficient(gval, offsets, t + 3) * x[tok[U(t + 3)]]
            t += 4
        while t < e:
            a0 += _entry_coefficient(gval, offsets, t) * x[tok[U(t)]]
            t += 1
        s = (a0 + a1) + (a2 + a3)
        while p < nout and outliers[p, 0] < e:
            s += np.float32(outliers[p, 1]) * x[tok[U(outliers[p, 0])]]
            p += 1
        y[r] = base + scale * s


@kernel
def _mv_entries(cuts, tok, rowng, gval, offsets, outliers, x, base, scale, y):
    """The entries coding's matvec, serially over the chunks of ``cuts`` (int64 [c + 1, 3]: first
    row, its token offset and its first outlier, of every chunk and of the end); the rest as in
    :func:`_mv_entries_rows`."""
    for c in range(cuts.shape[0] - 1):
        _mv_entries_rows(cuts[c, 0], cuts[c + 1, 0], cuts[c, 1], cuts[c, 2], tok, rowng, gval, offsets, outliers,
                         x, base, scale, y)


@parallel_kernel
def _mv_entries_par(cuts, tok, rowng, gval, offsets, outliers, x, base, scale, y):
    """:func:`_mv_entries` with the chunks on threads."""
    for c in prange(cuts.shape[0] - 1):
        _mv_entries_rows(cuts[c, 0], cuts[c + 1, 0], cuts[c, 1], cuts[c, 2], tok, rowng, gval, offsets, outliers,
                         x, base, scale, y)


@parallel_kernel
def _mv_par(kind, nchunks, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y):
    for c in prange(nchunks):
        b0 = _chunk_bound(blk_tok, c, nchunks)
        b1 = _chunk_bound(blk_tok, c + 1, nchunks)
        if kind == 0:
            _mv_abs(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y)
        elif kind == 1:
            _mv_abs_flat(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y)
        elif kind == 2:
            _mv_d8(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y)
        else:
            _mv_d4(b0, b1, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, x, xsum, y)


# --------------------------------------------------------------------------------------------------
# matmat: Y = W @ X with X [n, B] and Y [m, B] C-contiguous, so that the B inputs of one column are
# adjacent and every token is decoded once for the whole batch.
# --------------------------------------------------------------------------------------------------


@kernel
def _mm(b0, b1, coding, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, X, xsum, Y):
    # Per group: decode the columns into ``cols`` (without a branch on escapes: every token writes
    # its position, only real elements advance), then add the rows X[col, :] four at a time.
    m = Y.shape[0]
    nb = Y.shape[1]
    v0 = values[0]
    acc = np.empty(nb, dtype=np.float32)
    cols = np.empty(X.shape[0] + 1, dtype=np.int64)
    t = np.int64(blk_tok[b0])
    g = np.int64(blk_grp[b0])
    r0 = b0 * ROWS_PER_BLOCK
    r1 = min(m, b1 * ROWS_PER_BLOCK)
    # The rows' starting values in one flat pass (Y is C-contiguous): a loop per row costs more than
    # the products on nearly empty matrices.
    flat = Y.reshape(-1)
    if v0 != 0:
        for k in range(r0 * nb, r1 * nb):
            flat[U(k)] = v0 * xsum[U(k % nb)]
    else:
        for k in range(r0 * nb, r1 * nb):
            flat[U(k)] = 0.0
    for r in range(r0, r1):
        ng = np.int64(rowng[U(r)])
        if coding == CODING_ENTRIES:
            for k in range(t, t + ng):
                rank = np.int64(gval[U(k)]) if gval is not None else np.int64(0)
                cf = values[U(rank)] - v0
                p0 = np.int64(tok[U(k)])
                for j in range(nb):
                    Y[r, j] += cf * X[U(p0), j]
            t += ng
            continue
        for i in range(ng):
            cnt = np.int64(gcnt[U(g)])
            if gval is None:
                rank = i + 1
            else:
                rank = np.int64(gval[U(g)])
            g += 1
            if coding == CODING_ABSOLUTE:
                for k in range(cnt):
                    cols[U(k)] = tok[U(t + k)]
                q = cnt
                t += cnt
            elif coding == CODING_DELTA8:
                q = np.int64(0)
                p = np.int64(-1)
                for k in range(cnt):
                    d = np.int64(tok[U(t + k)])
                    p += d + (d != ESC8)
                    cols[U(q)] = p
                    q += d != ESC8
                t += cnt
            else:
                q = np.int64(0)
                p = np.int64(-1)
                for k in range(cnt):
                    d = (np.int64(tok[U(t + (k >> 1))]) >> ((k & 1) << 2)) & 15
                    p += d + (d != ESC4)
                    cols[U(q)] = p
                    q += d != ESC4
                t += (cnt + 1) >> 1
            if q == 0:
                continue
            cf = values[U(rank)] - v0
            if q == 1:
                p0 = cols[0]
                for j in range(nb):
                    Y[r, j] += cf * X[U(p0), j]
                continue
            for j in range(nb):
                acc[j] = 0.0
            k = np.int64(0)
            while k + 4 <= q:
                p0 = cols[U(k)]
                p1 = cols[U(k + 1)]
                p2 = cols[U(k + 2)]
                p3 = cols[U(k + 3)]
                for j in range(nb):
                    acc[j] += (X[U(p0), j] + X[U(p1), j]) + (X[U(p2), j] + X[U(p3), j])
                k += 4
            while k < q:
                p0 = cols[U(k)]
                for j in range(nb):
                    acc[j] += X[U(p0), j]
                k += 1
            for j in range(nb):
                Y[r, j] += cf * acc[j]


@parallel_kernel
def _mm_par(nchunks, coding, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, X, xsum, Y):
    for c in prange(nchunks):
        b0 = _chunk_bound(blk_tok, c, nchunks)
        b1 = _chunk_bound(blk_tok, c + 1, nchunks)
        _mm(b0, b1, coding, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, X, xsum, Y)


# --------------------------------------------------------------------------------------------------
# back to dense (values: float32 -> the dense matrix; int32 level codebook -> the level matrix)
# --------------------------------------------------------------------------------------------------


@kernel
def _expand(b0, b1, coding, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, out):
    m = out.shape[0]
    t = np.int64(blk_tok[b0])
    g = np.int64(blk_grp[b0])
    for r in range(b0 * ROWS_PER_BLOCK, min(m, b1 * ROWS_PER_BLOCK)):
        out[r, :] = values[0]
        ng = np.int64(rowng[U(r)])
        if coding == CODING_ENTRIES:
            for k in range(t, t + ng):
                rank = np.int64(gval[U(k)]) if gval is not None else np.int64(0)
                out[r, tok[U(k)]] = values[U(rank)]
            t += ng
            continue
        for i in range(ng):
            cnt = np.int64(gcnt[U(g)])
            if gval is None:
                rank = i + 1
            else:
                rank = np.int64(gval[U(g)])
            g += 1
            v = values[U(rank)]
            if coding == CODING_ABSOLUTE:
                for k in range(t, t + cnt):
                    out[r, tok[U(k)]] = v
                t += cnt
            else:
                p = np.int64(-1)
                for k in range(cnt):
                    if coding == CODING_DELTA8:
                        d = np.int64(tok[U(t + k)])
                        esc = ESC8
                    else:
                        d = (np.int64(tok[U(t + (k >> 1))]) >> ((k & 1) << 2)) & 15
                        esc = ESC4
                    if d == esc:
                        p += esc
                    else:
                        p += d + 1
                        out[r, p] = v
                t += (cnt + 1) >> 1 if coding == CODING_DELTA4 else cnt


@parallel_kernel
def _expand_par(nchunks, coding, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, out):
    for c in prange(nchunks):
        b0 = _chunk_bound(blk_tok, c, nchunks)
        b1 = _chunk_bound(blk_tok, c + 1, nchunks)
        _expand(b0, b1, coding, tok, gcnt, rowng, gval, blk_tok, blk_grp, values, out)


# --------------------------------------------------------------------------------------------------
# construction from a rank matrix (int32 [m, n], 0 = the implicit value)
# --------------------------------------------------------------------------------------------------


@kernel
def _group_row(row, cnt, pos, touched, cols):
    """Sort one row's non-implicit entries by (rank, column): ``cols`` holds the columns group after
    group, ``touched[:nt]`` the ranks present in ascending order and ``cnt[rank]`` their sizes.
    ``cnt`` must be all zero on entry; the caller clears the touched entries afterwards."""
    nt = 0
    for j in range(row.shape[0]):
        rk = row[j]
        if rk != 0:
            if cnt[rk] == 0:
                touched[nt] = rk
                nt += 1
            cnt[rk] += 1
    touched[:nt].sort()
    off = 0
    for i in range(nt):
        rk = touched[i]
        pos[rk] = off
        off += cnt[rk]
    for j in range(row.shape[0]):
        rk = row[j]
        if rk != 0:
            cols[pos[rk]] = j
            pos[rk] += 1
    return nt


@kernel
def _delta_tokens(cols, start, stop, esc):
    """Tokens needed to delta-code the ascending columns cols[start:stop] with escape value esc."""
    n = 0
    prev = -1
    for k in range(start, stop):
        gap = np.int64(cols[k]) - prev - 1
        n += 1 + gap // esc
        prev = cols[k]
    return n


@parallel_kernel
def _build_stats(ranks, nranks, nchunks, stats):
    """Per row: stats[r] = (non-implicit entries, delta8 bytes, delta4 bytes, CER groups (highest
    rank present), CSER groups (ranks present), largest group in entries, in delta8 tokens, in
    delta4 tokens, delta4 tokens)."""
    m, n = ranks.shape
    for c in prange(nchunks):
        cnt = np.zeros(nranks, dtype=np.int64)
        pos = np.zeros(nranks, dtype=np.int64)
        touched = np.empty(n, dtype=np.int64)
        cols = np.empty(n, dtype=np.int64)
        for r in range(m * c // nchunks, m * (c + 1) // nchunks):
            nt = _group_row(ranks[r], cnt, pos, touched, cols)
            nnz = 0
            t8 = 0
            t4 = 0
            n4 = 0
            big = 0
            big8 = 0
            big4 = 0
            for i in range(nt):
                rk = touched[i]
                k = cnt[rk]
                d8 = _delta_tokens(cols, nnz, nnz + k, ESC8)
                d4 = _delta_tokens(cols, nnz, nnz + k, ESC4)
                nnz += k
                t8 += d8
                t4 += (d4 + 1) >> 1
                n4 += d4
                big = max(big, k)
                big8 = max(big8, d8)
                big4 = max(big4, d4)
                cnt[rk] = 0
            stats[r, 0] = nnz
            stats[r, 1] = t8
            stats[r, 2] = t4
            stats[r, 3] = touched[nt - 1] if nt > 0 else 0
            stats[r, 4] = nt
            stats[r, 5] = big
            stats[r, 6] = big8
            stats[r, 7] = big4
            stats[r, 8] = n4


@parallel_kernel
def _build_fill(ranks, nranks, nchunks, coding, tok_off, grp_off, tok, gcnt, rowng, gval):
    """Write the tokens, group sizes, row group counts and (CSER, ``gval`` not None) group ranks at
    the offsets computed from ``_build_stats``."""
    m, n = ranks.shape
    for c in prange(nchunks):
        cnt = np.zeros(nranks, dtype=np.int64)
        pos = np.zeros(nranks, dtype=np.int64)
        touched = np.empty(n, dtype=np.int64)
        cols = np.empty(n, dtype=np.int64)
        for r in range(m * c // nchunks, m * (c + 1) // nchunks):
            nt = _group_row(ranks[r], cnt, pos, touched, cols)
            t = tok_off[r]
            g = grp_off[r]
            src = 0
            next_rank = 1
            for i in range(nt):
                rk = touched[i]
                k = cnt[rk]
                if gval is None:
                    while next_rank < rk:  # CER: empty groups for the ranks absent from this row
                        gcnt[g] = 0
                        g += 1
                        next_rank += 1
                    next_rank = rk + 1
                t0 = t
                nib = 0
                if coding == CODING_ABSOLUTE:
                    for q in range(src, src + k):
                        tok[t] = cols[q]
                        t += 1
                elif coding == CODING_DELTA8:
                    prev = -1
                    for q in range(src, src + k):
                        gap = np.int64(cols[q]) - prev - 1
                        while gap >= ESC8:
                            tok[t] = ESC8
                            t += 1
                            gap -= ESC8
                        tok[t] = gap
                        t += 1
                        prev = cols[q]
                else:
                    prev = -1  # nib counts the nibbles written in this group; it starts on a byte
                    for q in range(src, src + k):
                        gap = np.int64(cols[q]) - prev - 1
                        prev = cols[q]
                        while True:
                            d = ESC4 if gap >= ESC4 else gap
                            gap -= ESC4
                            if nib & 1:
                                tok[t] |= d << 4
                                t += 1
                            else:
                                tok[t] = d
                            nib += 1
                            if d != ESC4:
                                break
                    if nib & 1:
                        t += 1  # the high nibble of the last byte stays 0 (outside the group)
                gcnt[g] = nib if coding == CODING_DELTA4 else t - t0
                if gval is not None:
                    gval[g] = rk
                g += 1
                src += k
                cnt[rk] = 0
            rowng[r] = g - grp_off[r]


@parallel_kernel
def _build_fill_entries(ranks, nchunks, tok_off, tok, rowng, gval):
    """The "entries" coding: every non-implicit entry's column and rank, row after row."""
    m, n = ranks.shape
    for c in prange(nchunks):
        for r in range(m * c // nchunks, m * (c + 1) // nchunks):
            t = tok_off[r]
            for j in range(n):
                rk = ranks[r, j]
                if rk != 0:
                    tok[t] = j
                    gval[t] = rk
                    t += 1
            rowng[r] = t - tok_off[r]
