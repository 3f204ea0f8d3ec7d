"""The element passes of batched DynaQuant (quant/dqbatch.py) as numba kernels over segments.

Each kernel walks one packed chunk (segments = tensors) once; per segment it gets the partition
parameters (prune threshold and metric, protect thresholds, whether a gradient is packed) as the
float32 compares of ``dynaquant._partition`` see them. The plain-torch reference of both passes is
``dynaquant.quantize_reference`` (tests/test_quant_dqbatch.py checks codes, histograms and
protected values equal)::

    bad = partition_hist_kernel(...)   # quantized-value histogram rows, pruned / protected counts
    assign_kernel(...)                 # codes and the protected values in index order

and the decoder's lookup, ``dequantize_kernel`` (reference: ``dynaquant.dequantize_reference``).

Where no segment uses a gradient and none protects a value it prunes, the partition's rows come
from the sketch's signed rows instead (``partition_counts_kernel`` counts, ``trim_rows_kernel``):
a bucket holds one band of |x|, so the pruned values of one sign are the first of its rows' cells
in |x| order and the protected ones the last. Counting needs compares only (it vectorizes), and
no value is bucketed twice.
"""
from __future__ import annotations

import numpy as np

from ..logbuckets import HAVE_NUMBA

if HAVE_NUMBA:
    import numba as _numba

    from ..logbuckets import bucket_fold, emit_counts, fold_rows

__all__ = ["partition_hist_kernel", "partition_counts_kernel", "trim_rows_kernel", "assign_kernel",
           "dequantize_kernel"]

if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True, inline="always")
    def _part(v, gi, hg, prune, on_sens, pm, ps):  # pragma: no cover - compiled
        """(pruned, protected) of one value, as dynaquant._partition (protection wins). Written as
        selects, not branches: the loops around it vectorize (4x faster)."""
        a = abs(v)
        if hg:
            sens = abs(v * gi)
            return (v == 0) | ((sens if on_sens else a) < prune), (a > pm) | (sens > ps)
        return (v == 0) | (a < prune), a > pm

    @_numba.njit(cache=True, nogil=True)
    def partition_hist_kernel(bits, x, g, offsets, prune, on_sens, pm, ps, has_g, shift, key, bound, M,
                          ords, counts, ptr, n_pruned, n_prot):  # pragma: no cover - compiled
        d = np.zeros((4, 2 * M + 2), dtype=np.int64)
        f = np.zeros(2 * M + 2, dtype=np.int64)
        n = 0
        zero = np.float32(0.0)
        for s in range(offsets.shape[0] - 1):
            lo, hi = 2 * M + 1, 0
            npr = 0
            npt = 0
            hg = has_g[s]
            bad = 0
            for i in range(np.uint64(offsets[s]), np.uint64(offsets[s + 1])):  # unsigned: see run below
                prn, prt = _part(x[i], g[i] if hg else zero, hg, prune[s], on_sens[s], pm[s], ps[s])
                j = bucket_fold(bits[i], x[i], shift, key, bound)
                bad = min(bad, j)
                q = not (prn | prt)
                d[i & 3, max(j, 0)] += q
                lo = min(lo, j if q else lo)
                hi = max(hi, j if q else hi)
                npr += prn & (not prt)
                npt += prt
            if bad < 0:
                return s
            fold_rows(d, lo, hi, f)
            n = emit_counts(f, lo, hi, False, True, ords, counts, n)
            ptr[s + 1] = n
            n_pruned[s] = npr
            n_prot[s] = npt
        return -1

    @_numba.njit(cache=True, nogil=True)
    def partition_counts_kernel(bits, x, offsets, prune, pm, zero_bound, out):  # pragma: no cover - compiled
        """Per segment s, as _part sees them without a gradient: out[s] = (pruned, pruned and
        negative, protected, protected and negative, in the zero bucket, in it and negative); the
        zero bucket is |x| <= zero_bound (float32, rounded down as lookup_table's bounds)."""
        z = np.float32(0.0)
        for s in range(offsets.shape[0] - 1):
            a_n = a_neg = c_n = c_neg = z_n = z_neg = 0
            for i in range(np.uint64(offsets[s]), np.uint64(offsets[s + 1])):  # selects: vectorizes
                v = x[i]
                a = abs(v)
                neg = bits[i] < 0
                prn = (v == z) | (a < prune[s])
                prt = a > pm[s]
                zb = not (a > zero_bound)
                a_n += prn
                a_neg += prn & neg
                c_n += prt
                c_neg += prt & neg
                z_n += zb
                z_neg += zb & neg
            out[s, 0], out[s, 1], out[s, 2], out[s, 3], out[s, 4], out[s, 5] = a_n, a_neg, c_n, c_neg, z_n, z_neg

    @_numba.njit(cache=True, nogil=True)
    def trim_rows_kernel(ords, counts, ptr, cnt, q_ords, q_counts, q_ptr):  # pragma: no cover - compiled
        """Each segment's signed row (ords, counts, ptr: emit_counts's order, negative ordinals
        from the most negative, the zero bucket one cell of both signs) less, one sign at a time,
        its pruned values from the smallest |x| up and its protected ones from the largest down
        (cnt: partition_counts_kernel's) -> the quantized values' rows as partition_hist_kernel
        emits them (cells of count 0 dropped)."""
        n = 0
        for s in range(ptr.shape[0] - 1):
            a, e = ptr[s], ptr[s + 1]
            c = counts[a:e].copy()
            o = ords[a:e]
            nonneg = 0  # the first cell at or above ordinal 0
            while nonneg < o.size and o[nonneg] < 0:
                nonneg += 1
            zc = nonneg if nonneg < o.size and o[nonneg] == 0 else -1
            for neg in (True, False):
                pruned = cnt[s, 1] if neg else cnt[s, 0] - cnt[s, 1]
                prot = cnt[s, 3] if neg else cnt[s, 2] - cnt[s, 3]
                zs = cnt[s, 5] if neg else cnt[s, 4] - cnt[s, 5]  # this sign's share of the zero cell
                take = min(pruned, zs)  # the zero bucket holds the smallest |x|
                if take:
                    c[zc] -= take
                pruned -= take
                zs -= take
                # this sign's other cells from the smallest |x| (first) to the largest (last)
                if neg:
                    first, last, step = nonneg - 1, 0, -1
                else:
                    first, last, step = nonneg + (zc >= 0), o.size - 1, 1
                if (last - first) * step < 0:
                    first = last + step  # none: both walks end at once
                j = first
                while pruned and j != last + step:
                    t = min(pruned, c[j])
                    c[j] -= t
                    pruned -= t
                    j += step
                j = last
                while prot and j != first - step:
                    t = min(prot, c[j])
                    c[j] -= t
                    prot -= t
                    j -= step
                if prot:  # protected zero-bucket values: a protect bound below the zero bucket's
                    c[zc] -= min(prot, zs)
            for j in range(o.size):
                if c[j]:
                    q_ords[n] = o[j]
                    q_counts[n] = c[j]
                    n += 1
            q_ptr[s + 1] = n

    def _assign_range(width: int):
        """Codes of x[a:e] against boundaries b padded to ``width`` with +inf (0: any width, by
        binary search). The boundary count is branch-free with a constant trip count, so LLVM
        vectorizes across values, given unsigned indices: numba wraps a signed index that could be
        negative (a compare and a select per access), which kept LLVM from vectorizing (0.55 ns per
        value for k = 16, 1.85 ms -> 0.22 ms on 0.4M values; 6 ns with a binary search)."""
        @_numba.njit(cache=True, nogil=True)
        def run(x, g, a, e, hg, b, prune, on_sens, pm, ps, top, codes):  # pragma: no cover - compiled
            z = np.float32(0.0)
            for i in range(np.uint64(a), np.uint64(e)):
                v = x[i]
                c = 0
                if width:
                    for j in range(width):
                        c += b[j] < v
                else:
                    hi = b.shape[0]
                    while c < hi:
                        h = (c + hi) >> 1
                        if b[h] < v:
                            c = h + 1
                        else:
                            hi = h
                prn, prt = _part(v, g[i] if hg else z, hg, prune, on_sens, pm, ps)
                codes[i] = top if prt else (0 if prn else c + 1)
        return run

    _assign3, _assign7, _assign15, _assign31, _assign63, _assign_any = (
        _assign_range(w) for w in (3, 7, 15, 31, 63, 0))

    @_numba.njit(cache=True, nogil=True)
    def _assign_segment(x, g, a, e, hg, b, m, prune, on_sens, pm, ps, top, codes):  # pragma: no cover
        if m <= 3:
            _assign3(x, g, a, e, hg, b, prune, on_sens, pm, ps, top, codes)
        elif m <= 7:
            _assign7(x, g, a, e, hg, b, prune, on_sens, pm, ps, top, codes)
        elif m <= 15:
            _assign15(x, g, a, e, hg, b, prune, on_sens, pm, ps, top, codes)
        elif m <= 31:
            _assign31(x, g, a, e, hg, b, prune, on_sens, pm, ps, top, codes)
        elif m <= 63:
            _assign63(x, g, a, e, hg, b, prune, on_sens, pm, ps, top, codes)
        else:
            _assign_any(x, g, a, e, hg, b[:m], prune, on_sens, pm, ps, top, codes)

    @_numba.njit(cache=True, nogil=True)
    def assign_kernel(x, g, offsets, prune, on_sens, pm, ps, has_g, B, nb, ks, codes, prot,
                       prot_off):  # pragma: no cover - compiled
        for s in range(offsets.shape[0] - 1):
            a, e = offsets[s], offsets[s + 1]
            m = nb[s]
            top = ks[s] + 1
            _assign_segment(x, g, a, e, has_g[s], B[s], m, prune[s], on_sens[s], pm[s], ps[s], top, codes)
            q = prot_off[s]
            if prot_off[s + 1] > q:
                for i in range(np.uint64(a), np.uint64(e)):  # protected values, in index order
                    if codes[i] == top:
                        prot[q] = x[i]
                        q += 1
else:  # pragma: no cover
    partition_hist_kernel = partition_counts_kernel = trim_rows_kernel = assign_kernel = None


if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True)
    def dequantize_kernel(codes, codebook, top, prot, out):  # pragma: no cover - compiled
        """out[i] = codebook[codes[i]], or the next protected value where codes[i] == top. Returns
        the protected values used; -1 when codes ``top`` outnumber them, -2 for a code outside the
        codebook (a file's codes are not trusted: no read past the arrays)."""
        j = 0
        n_cb = codebook.shape[0]
        for i in range(codes.shape[0]):
            c = codes[i]
            if c == top:
                if j >= prot.shape[0]:
                    return -1
                out[i] = prot[j]
                j += 1
            elif c < 0 or c >= n_cb:
                return -2
            else:
                out[i] = codebook[c]
        return j
else:  # pragma: no cover
    dequantize_kernel = None
