"""The moment codec's passes (quant/moments.py) as numba kernels: one pass each where the
plain-torch reference beside them in quant/moments.py takes several (casts, compares, masks: on a
checkpoint's ~1M moment values each torch pass costs about a millisecond, the kernels a fraction).
Every float operation in them is correctly rounded fp32 (division, sqrt) or an fp64 sum rounded
once, as the reference computes it, so their results are the reference's bit for bit
(tests/test_quant_moments.py); CUDA tensors and hosts without numba run the reference::

    top = grid_kernel(vf, mf, offsets, bc2, eps, lo, thr, B, width, pow2, D, out)
                                            # D and v's grid codes (moments.grid_bounds) of every tensor,
                                            # and max(c); -1: a value not finite (the caller names it)
    order_pairs(x, at, ranks, lo, hi)       # each segment's ranks[s]-th and next order statistics
    abs_cuts(mf, D, offsets, strides, ranks, lo, hi, buf)  # each tensor's prune cut: order_pairs of a
                                            # strided sample of its |m / D|, a tensor at a time in buf
    sign_kernel(mf, D, offsets, group, cuts, has_cut, scale, out)  # 1-bit direction: bf16 scales, codes
    eff = factored_effects(c, rows, cols, a, b)  # a grid's row and column effects (as torch's means), max |effect|
    top = factored_tail(c, a, b, out)       # zigzag(c - (a[row] + b[col])) of a (rows, cols) grid, and its max
    low = factored_levels(z, a, b, out)     # its inverse (decode): unzigzag(z) + a[row] + b[col], and its min
    direction_values(c, levels, scale, group, D, normalized, out)  # decode: levels[c] * scale[i // group] (* D)
    ok = level_values(c, table, out)              # decode: out = table[c]; False: a code past the table
    ok = direction_by_level(c, levels, scale, group, vc, d_table, normalized, out)  # direction_values with
                                            # D = d_table[vc], and 0 where vc == 0; False: a v code past it

Outputs may be narrower than int64 (the caller bounds them): on GPT-2 124M's embedding each int64
output was 309 MB of fresh pages per save.

``factored_tail`` replaces six passes over int64 (the float sum of the effects, its cast, the
subtraction, the zigzag's shift, shift and xor) and the max after them: ~15 % of a dynaquant save
of GPT-2 124M (docs/BENCHMARKS.md, issue 15).
"""
from __future__ import annotations

import numpy as np

from ..logbuckets import HAVE_NUMBA

if HAVE_NUMBA:
    import numba as _numba

__all__ = ["HAVE_NUMBA", "grid_kernel", "order_pairs", "abs_cuts", "sign_kernel", "factored_effects",
           "factored_tail", "factored_levels", "direction_values", "level_values", "direction_by_level"]

if HAVE_NUMBA:
    _EXP = np.uint32(0x7F800000)  # an fp32 whose exponent bits are all set is inf or NaN
    _ABS = np.uint32(0x7FFFFFFF)  # an fp32 without its sign bit: 0 for +0 and -0
    # _DIVIDES: a kernel whose loops divide floats (never by zero: D >= eps > 0, scales >= 1e-38).
    # numba's default (Python) error model tests each divisor to raise ZeroDivisionError, and that
    # branch keeps LLVM from vectorizing the loop: |m / D| over 0.48M values took 0.41 ms, 0.06 ms
    # without it. The quotients are IEEE's either way (the same bits).
    _DIVIDES = dict(cache=True, nogil=True, error_model="numpy")
    # _U: a loop indexes with unsigned integers where its range starts at a loaded offset: numba wraps
    # a signed index that could be negative (a compare and a select per access), which keeps LLVM
    # from vectorizing the loop (the grid's first pass: 0.55 -> 0.08 ms on 0.48M values)

    @_numba.njit(cache=True, nogil=True)
    def _grid_codes1(vb, mb, lo, thr, out):  # pragma: no cover - compiled
        """grid_kernel's codes where a binade holds at most one bound (step >= 1): its own loop, ~3x
        faster than inside the general one."""
        yb = out.view(np.uint32)
        top = np.int32(0)
        one = np.int32(1)
        for i in range(vb.shape[0]):
            b = yb[i]
            x = b >> np.uint32(23)
            c = max(lo[x] + np.int32(b >= thr[x]), one)
            c = c if ((vb[i] | mb[i]) & _ABS) != np.uint32(0) else np.int32(0)  # +-0: v == 0 == m
            out[i] = c
            top = max(top, c)
        return np.int64(top)

    @_numba.njit(cache=True, nogil=True)
    def _grid_codes_pow2(vb, mb, s, out):  # pragma: no cover - compiled
        """_grid_codes1 where the step is 2**s (s >= 1): every bound is then a power of two at a
        binade's start (2**(step k - step/2)), so c = (e + step/2) >> s of y's exponent e >= 0, the
        table's count without its two lookups a value (0.47 -> 0.1 ms on 0.48M values; y = inf, e =
        128, gives every bound, as the table)."""
        yb = out.view(np.uint32)
        bias = np.int32((1 << s) // 2 - 127)  # x + bias = e + step/2, x: y's exponent bits (y >= 1)
        sh = np.int32(s)
        top = np.int32(0)
        one = np.int32(1)
        for i in range(np.uint64(vb.shape[0])):  # unsigned: see _U
            c = max((np.int32(yb[i] >> np.uint32(23)) + bias) >> sh, one)
            c = c if ((vb[i] | mb[i]) & _ABS) != np.uint32(0) else np.int32(0)  # +-0: v == 0 == m
            out[i] = c
            top = max(top, c)
        return np.int64(top)

    @_numba.njit(**_DIVIDES)
    def grid_kernel(vf, mf, offsets, bc2, eps, lo, thr, B, width, pow2, D, out):  # pragma: no cover - compiled
        """Adam's denominator and v's grid codes of every segment (tensor) of flat fp32 ``vf`` (and
        ``mf``, or empty): D = sqrt(max(v, 0) / bc2[s]) + eps[s] (fp32, correctly rounded: torch's CPU
        sqrt is not: base.sqrt_rn), y = D / eps[s] >= 1 and c = #{k >= 1: B[k] <= y}
        from y's exponent bits x: lo[x] bounds lie below its binade, then the ``width`` bounds after
        them are compared (one: the bits thr[x]); c at least 1, 0 where v == 0 == m. Writes D and the
        codes (int32; y is kept in ``out`` between the passes); returns max(c), or -1 when a value is
        not finite (the caller names it). ``pow2``: s where the step is 2**s (s >= 1: the codes
        without the tables, _grid_codes_pow2), else 0. Both loops are branch-free: LLVM vectorizes the first
        (sqrt and division included); the second is table lookups."""
        has_m = mf.shape[0] == vf.shape[0]
        vb = vf.view(np.uint32)
        mb = mf.view(np.uint32) if has_m else vb
        y = out.view(np.float32)
        zero = np.float32(0.0)
        bad = np.uint32(0)
        for s in range(offsets.shape[0] - 1):
            b2, e = bc2[s], eps[s]
            for i in range(np.uint64(offsets[s]), np.uint64(offsets[s + 1])):  # unsigned: see _U
                bad |= ((vb[i] & _EXP) == _EXP) | ((mb[i] & _EXP) == _EXP)
                d = np.sqrt(max(vf[i], zero) / b2) + e
                D[i] = d
                y[i] = d / e
        if bad:
            return np.int64(-1)
        if pow2:
            return _grid_codes_pow2(vb, mb, pow2, out)
        if width == 1:
            return _grid_codes1(vb, mb, lo, thr, out)
        yb = out.view(np.uint32)
        top = np.int32(0)
        for i in range(vf.shape[0]):
            x = yb[i] >> np.uint32(23)
            yi = y[i]
            base = lo[x]
            c = base
            for j in range(1, width + 1):
                c += np.int32(yi >= B[base + j])
            c = max(c, np.int32(1))
            c = c if ((vb[i] | mb[i]) & _ABS) != np.uint32(0) else np.int32(0)  # +-0: v == 0 == m
            out[i] = c
            top = max(top, c)
        return np.int64(top)

    @_numba.njit(cache=True, nogil=True)
    def order_pairs(x, at, ranks, lo, hi):  # pragma: no cover - compiled
        """Of every segment x[at[s]:at[s + 1]] of fp32 ``x`` (no NaN; -0 sorts below +0), the
        ranks[s]-th smallest value (0-based) into lo[s] and the next one into hi[s] (lo[s] again
        when there is none): what a sort puts there, so torch.kthvalue's bits (``_pair``)."""
        xb, lob, hib = x.view(np.uint32), lo.view(np.uint32), hi.view(np.uint32)
        fine = np.zeros(65536, dtype=np.int64)
        coarse = np.zeros(1024, dtype=np.int64)
        for s in range(at.shape[0] - 1):
            a, e = np.uint64(at[s]), np.uint64(at[s + 1])  # unsigned: see _U
            if e > a:
                lob[s], hib[s] = _pair(xb, a, e, ranks[s], fine, coarse)

    @_numba.njit(**_DIVIDES)
    def abs_cuts(mf, D, offsets, strides, ranks, lo, hi, buf):  # pragma: no cover - compiled
        """Each segment's |u| (u = m / D, or m where D is empty) at every ``strides[s]``-th element,
        into ``buf`` (fp32, as long as the largest sample), then its ranks[s]-th and next order
        statistics into lo[s], hi[s] (order_pairs): a tensor at a time, so its sample (at most ~131K
        values) is still in cache for the select's passes, where the whole batch's sample was
        written first and then read three times from memory. Empty segments are skipped (their lo,
        hi untouched)."""
        has_d = D.shape[0] == mf.shape[0]
        xb, lob, hib = buf.view(np.uint32), lo.view(np.uint32), hi.view(np.uint32)
        fine = np.zeros(65536, dtype=np.int64)
        coarse = np.zeros(1024, dtype=np.int64)
        for s in range(offsets.shape[0] - 1):
            n, st = offsets[s + 1] - offsets[s], strides[s]
            if n <= 0:
                continue
            k = 0
            if st == 1 and has_d:  # the whole tensor (under 131072 elements)
                a = np.uint64(offsets[s])
                for j in range(np.uint64(n)):  # unsigned: see _U; a loop LLVM vectorizes
                    buf[j] = abs(mf[a + j] / D[a + j])
                k = n
            else:
                for i in range(offsets[s], offsets[s + 1], st):
                    buf[k] = abs(mf[i] / D[i]) if has_d else abs(mf[i])
                    k += 1
            lob[s], hib[s] = _pair(xb, np.uint64(0), np.uint64(k), ranks[s], fine, coarse)

    @_numba.njit(cache=True, inline="always")
    def _pair(xb, a, e, r, fine, coarse):  # pragma: no cover - compiled
        """The bits of the r-th smallest of the fp32 values with bits xb[a:e] (a < e) and of the
        next one (the r-th again when there is none). A radix select on the values' ordered bits:
        a histogram of their top 16 bits (and of their top 8, to find the bin in two short scans)
        names the bin holding the rank; a second pass takes the least value above that bin (a loop
        LLVM vectorizes) and gathers the bin's values (a few hundred of a 65536-value sample), and
        only those are sorted. ``fine`` (65536) and ``coarse`` (4 x 256) are zero on entry and on
        return. Neighbouring values mostly share a coarse bin: four interleaved copies of its
        counts keep consecutive increments off one counter (0.83 -> 0.76 ms on a small GPT's cuts)."""
        none = np.uint32(0xFFFFFFFF)  # no value's key (+NaN's)
        four, one, c1, c2, c3 = np.uint64(4), np.uint64(1), np.uint32(256), np.uint32(512), np.uint32(768)
        i = a
        while i + four <= e:
            t0 = _ordered(xb[i]) >> np.uint32(16)
            t1 = _ordered(xb[i + one]) >> np.uint32(16)
            t2 = _ordered(xb[i + np.uint64(2)]) >> np.uint32(16)
            t3 = _ordered(xb[i + np.uint64(3)]) >> np.uint32(16)
            fine[t0] += 1
            fine[t1] += 1
            fine[t2] += 1
            fine[t3] += 1
            coarse[t0 >> np.uint32(8)] += 1
            coarse[(t1 >> np.uint32(8)) + c1] += 1
            coarse[(t2 >> np.uint32(8)) + c2] += 1
            coarse[(t3 >> np.uint32(8)) + c3] += 1
            i += four
        while i < e:
            t = _ordered(xb[i]) >> np.uint32(16)
            fine[t] += 1
            coarse[t >> np.uint32(8)] += 1
            i += one
        for c in range(256):
            coarse[c] += coarse[c + 256] + coarse[c + 512] + coarse[c + 768]
        coarse[256:] = 0
        below, c = np.int64(0), 0
        while below + coarse[c] <= r:
            below += coarse[c]
            c += 1
        b = c << 8
        while below + fine[b] <= r:
            below += fine[b]
            b += 1
        m = fine[b]
        for c in range(256):  # the next segment starts clean
            if coarse[c]:
                fine[c << 8:(c + 1) << 8] = 0
                coarse[c] = 0
        bin_, above = np.uint32(b), none
        for i in range(a, e):
            v = _ordered(xb[i])
            above = min(above, v if v >> np.uint32(16) > bin_ else none)
        bucket = np.empty(m + 1, dtype=np.uint32)  # one more: every value is written, the bin's kept
        k = 0
        for i in range(a, e):
            v = _ordered(xb[i])
            bucket[k] = v
            k += (v >> np.uint32(16)) == bin_
        bucket = bucket[:m]
        bucket.sort()
        j = r - below
        return _unordered(bucket[j]), _unordered(bucket[j + 1] if j + 1 < m else above if above != none else bucket[j])

    @_numba.njit(cache=True, inline="always")
    def _ordered(v):  # pragma: no cover - compiled
        """fp32 bits -> an unsigned key in the values' order (negatives' bits flipped, below the rest)."""
        return np.uint32(v ^ (np.uint32(0xFFFFFFFF) if v >> np.uint32(31) else np.uint32(0x80000000)))

    @_numba.njit(cache=True, inline="always")
    def _unordered(k):  # pragma: no cover - compiled
        return np.uint32(k ^ (np.uint32(0x80000000) if k >> np.uint32(31) else np.uint32(0xFFFFFFFF)))

    @_numba.njit(**_DIVIDES)
    def sign_kernel(mf, D, offsets, group, cuts, has_cut, scale, out):  # pragma: no cover - compiled
        """1-bit direction codes of every segment: per group of ``group`` elements (the last one
        padded with zeros) the bf16 scale s = mean |u| of what it keeps (|u| > cuts[s]; without a
        cut every element, pads included), summed in fp64 and rounded once to fp32, then to bf16
        (nearest even, as torch), written as its bits; codes 2 / 0 by the sign of u / max(s, 1e-38),
        1 where |u| <= cut (without a cut: 1 / 0). ``out`` holds the padded groups, as the
        reference's. The fp64 sum runs in 4 lanes: its order moves only bits far below the fp32."""
        has_d = D.shape[0] == mf.shape[0]
        u = np.zeros(group + 4, dtype=np.float32)
        w = np.zeros(group + 4, dtype=np.float32)  # |u| where kept, else 0 (pads: 0)
        one = np.empty(1, dtype=np.float32)
        onebits = one.view(np.uint32)
        tiny = np.float32(1e-38)
        zero = np.float32(0.0)
        r = 0
        for s in range(offsets.shape[0] - 1):
            cut = cuts[s] if has_cut else np.float32(-1.0)
            for g0 in range(offsets[s], offsets[s + 1], group):
                k = min(group, offsets[s + 1] - g0)
                g = np.uint64(g0)  # unsigned: see _U
                cnt = 0
                if has_d:
                    for j in range(np.uint64(k)):
                        u[j] = mf[g + j] / D[g + j]
                else:
                    for j in range(np.uint64(k)):
                        u[j] = mf[g + j]
                for j in range(k, group + 4):
                    u[j] = zero
                for j in range(group):
                    a = abs(u[j])
                    kept = a > cut
                    w[j] = a if kept else zero
                    cnt += kept
                s0 = s1 = s2 = s3 = 0.0
                for j in range(0, group, 4):
                    s0 += w[j]
                    s1 += w[j + 1]
                    s2 += w[j + 2]
                    s3 += w[j + 3]
                if not has_cut:
                    cnt = group
                one[0] = np.float32(((s0 + s1) + (s2 + s3)) / max(cnt, 1))
                b = onebits[0]
                if one[0] != one[0]:
                    b16 = np.uint32(0x7FC0)
                else:
                    b16 = (b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16
                scale[r] = b16
                onebits[0] = b16 << 16
                sc = max(one[0], tiny)
                base = np.uint64(r * group)
                for j in range(np.uint64(group)):
                    x = u[j]
                    pos = np.uint8(1) if x / sc > zero else np.uint8(0)
                    if has_cut:
                        out[base + j] = pos * np.uint8(2) if abs(x) > cut else np.uint8(1)
                    else:
                        out[base + j] = pos
                r += 1

    @_numba.njit(**_DIVIDES)
    def factored_effects(c, rows, cols, a, b):  # pragma: no cover - compiled
        """The reference's row and column effects of the flat (rows, cols) integer grid ``c``: a[i] =
        round(mean of row i), b[j] = round(mean of column j of c - a) in fp32, as torch computes them
        (tests/test_quant_moments.py): each sum of integers exact (the caller keeps |sums| below
        2**24, where fp32 adds them exactly in any order), one correctly rounded division, round half
        to even. Returns max(|a|, |b|) (0 when empty)."""
        colsum = np.zeros(cols, dtype=np.int64)
        eff = np.float32(0.0)
        for i in range(rows):
            at = np.uint64(i * cols)  # unsigned: see _U
            acc = np.int64(0)
            for j in range(np.uint64(cols)):
                acc += np.int64(c[at + j])
            ai = np.rint(np.float32(acc) / np.float32(cols))
            a[i] = ai
            eff = max(eff, abs(ai))
            k = np.int64(ai)
            for j in range(np.uint64(cols)):
                colsum[j] += np.int64(c[at + j]) - k
        for j in range(cols):
            bj = np.rint(np.float32(colsum[j]) / np.float32(rows))
            b[j] = bj
            eff = max(eff, abs(bj))
        return eff

    @_numba.njit(cache=True, nogil=True)
    def factored_tail(c, a, b, out):  # pragma: no cover - compiled
        """out = zigzag(c - (a[i] + b[j])) over the flat (len(a), len(b)) integer grid ``c``, with fp32
        row / column effects holding integers below 2**15 (so their fp32 sum is exact, as the
        reference's); returns max(out) (0 when empty)."""
        cols = b.shape[0]
        bi = np.empty(cols, dtype=np.int64)
        for j in range(cols):
            bi[j] = np.int64(b[j])
        top = np.int64(0)
        for i in range(a.shape[0]):
            ai = np.int64(a[i])
            base = i * cols
            for j in range(cols):
                r = np.int64(c[base + j]) - (ai + bi[j])
                z = (r << 1) ^ (r >> 63)
                out[base + j] = z
                top = max(top, z)
        return top

    @_numba.njit(cache=True, nogil=True)
    def factored_levels(z, a, b, out):  # pragma: no cover - compiled
        """out = unzigzag(z) + (a[i] + b[j]) over the flat (len(a), len(b)) grid of zigzag codes ``z``
        (>= 0, any integer dtype) with integer row / column effects; returns min(out) (0 when empty).
        The reference's five int64 passes and its full-size prediction, in one."""
        cols = b.shape[0]
        low = np.int64(0)
        for i in range(a.shape[0]):
            ai = np.int64(a[i])
            base = i * cols
            for j in range(cols):
                zz = np.int64(z[base + j])
                c = ((zz >> 1) ^ -(zz & 1)) + ai + np.int64(b[j])
                out[base + j] = c
                low = min(low, c)
        return low

    @_numba.njit(cache=True, nogil=True)
    def direction_values(c, levels, scale, group, D, normalized, out):  # pragma: no cover - compiled
        """out[i] = levels[c[i]] * scale[i // group] (* D[i] when ``normalized``), fp32: the
        reference's index cast (8 fresh bytes a code), gather and two multiplies, in one pass over
        narrow codes. The caller has checked the codes against the levels and the scales' count."""
        n = c.shape[0]
        for g0 in range(0, n, group):
            f = scale[g0 // group]
            for i in range(g0, min(g0 + group, n)):
                u = levels[np.int64(c[i])] * f
                out[i] = u * D[i] if normalized else u

    @_numba.njit(cache=True, nogil=True)
    def level_values(c, table, out):  # pragma: no cover - compiled
        """out[i] = table[c[i]] in one pass over narrow codes; False where a code is past the table
        (nothing past it is read). The bound check is one compare, on the code's unsigned value: a
        negative int64 code fails it too."""
        size = np.uint64(table.shape[0])
        bad = False
        for i in range(c.shape[0]):
            k = np.uint64(c[i])
            if k >= size:
                bad = True
                k = np.uint64(0)
            out[i] = table[k]
        return not bad

    @_numba.njit(cache=True, nogil=True)
    def direction_by_level(c, levels, scale, group, vc, d_table, normalized, out):  # pragma: no cover - compiled
        """direction_values with D[i] = d_table[vc[i]] (v's codes and its denominator's value per
        level: no tensor of D) and then 0 where vc[i] == 0, the zero level of v (both moments were
        exactly zero), as the reference's masked write does; False where a code of v is past d_table."""
        n, size = c.shape[0], np.uint64(d_table.shape[0])
        bad = False
        zero = np.float32(0)
        for g0 in range(0, n, group):
            f = scale[g0 // group]
            for i in range(g0, min(g0 + group, n)):
                k = np.uint64(vc[i])
                if k >= size:
                    bad = True
                    k = np.uint64(0)
                u = levels[np.int64(c[i])] * f
                if normalized:
                    u = u * d_table[k]
                out[i] = u if k else zero
        return not bad
else:  # pragma: no cover
    grid_kernel = abs_cuts = order_pairs = sign_kernel = factored_effects = factored_tail = None
    factored_levels = direction_values = level_values = direction_by_level = None
