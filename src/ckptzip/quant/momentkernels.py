"""The moment codec's integer tails (quant/moments.py) as numba kernels: one pass each where the
plain-torch reference beside them in quant/moments.py takes several (compares, casts, masks: on a
checkpoint's ~1M moment values each pass costs about a millisecond). Both take the float values
torch computed and only compare, round and select, so their results are the reference's bit for
bit (tests/test_quant_moments.py); CUDA tensors and hosts without numba run the reference::

    top = grid_tail(t, vf, mf, out, limit)  # c = max(rint(t), 1), 0 where v == 0 (and m == 0), and max(c);
                                            # -1: a t not finite or over limit (out's dtype), run the reference
    sign_tail(ug, scale, cut, out)          # 1-bit direction codes: 2 / 0 by the sign of u / s, 1 where |u| <= cut
    top = factored_tail(c, a, b, out)       # zigzag(c - (a[row] + b[col])) of a (rows, cols) grid, and its max
    low = factored_levels(z, a, b, out)     # its inverse (decode): unzigzag(z) + a[row] + b[col], and its min

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

__all__ = ["HAVE_NUMBA", "grid_tail", "sign_tail", "factored_tail", "factored_levels"]

if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True)
    def grid_tail(t, vf, mf, out, limit):  # pragma: no cover - compiled
        """out = max(rint(t), 1), 0 where vf == 0 (and mf == 0 when mf is not empty) -> max(out);
        -1 (out unfinished) when a t is not finite or not below ``limit``: the caller runs the reference."""
        has_m = mf.shape[0] == t.shape[0]
        top = np.int64(0)
        for i in range(t.shape[0]):
            x = t[i]
            if not np.isfinite(x) or x >= limit:
                return np.int64(-1)
            c = np.int64(np.rint(x))
            if c < 1:
                c = 1
            if vf[i] == 0 and (not has_m or mf[i] == 0):
                c = 0
            out[i] = c
            top = max(top, c)
        return top

    @_numba.njit(cache=True, nogil=True)
    def sign_tail(ug, scale, cut, out):  # pragma: no cover - compiled
        """1-bit codes of (rows, group) fp32 ``ug`` with per-row fp32 ``scale`` (> 0): the sign of
        z = u / scale (z > 0: 1, else 0); with per-row ``cut`` (not empty): 2 / 0, and 1 where |u| <= cut."""
        has_cut = cut.shape[0] == ug.shape[0]
        for r in range(ug.shape[0]):
            s = scale[r]
            for j in range(ug.shape[1]):
                u = ug[r, j]
                pos = np.uint8(1) if u / s > np.float32(0) else np.uint8(0)
                if has_cut:
                    out[r, j] = pos * np.uint8(2) if abs(u) > cut[r] else np.uint8(1)
                else:
                    out[r, j] = pos

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
else:  # pragma: no cover
    grid_tail = sign_tail = factored_tail = factored_levels = None
