"""Log-bucket ordinals of many values at memory speed: the boundary table, float32 lookup tables,
numba kernels, and sketches of many segments of one buffer in one call.

The bucket of x is *defined* by one float64 table per (alpha, min_value), b[j] = gamma^(key(min_value)
+ j): |ordinal(x)| = number of b[j] < |x| (``boundary_table``); LogSketch (sketch.py) builds on it.
The plain-torch reference is that searchsorted (any device, any float dtype). On CPU a numba kernel
reads float32 bits instead: cell f = |bits| >> shift of a lookup table gives the ordinal, and the one
boundary that can fall inside a cell is a float32 compare, rounded down so that ``x > b32`` iff
``x > b``: both give the same ordinals bit for bit (tests/test_sketch.py). ~2-3 ns per value.

    (ords, counts, row_ptr), = segment_histograms(flat, offsets, alpha=0.01)     # one row per segment
    signed, absolute = segment_histograms(flat, offsets, kinds=("signed", "abs"))  # both, one pass
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from .errors import ConfigError, NonFiniteError

try:  # optional fast path; the torch reference is always available
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["boundary_table", "zero_key", "lookup_table", "segment_histograms", "ordinals", "ordinals_reference",
           "HAVE_NUMBA"]

HAVE_NUMBA = _numba is not None
_F32_MAX = float(torch.finfo(torch.float32).max)
_CHUNK = 1 << 22  # reference path: elements per searchsorted (bounds float64 temporaries)
_BLOCK = 1024     # _hist_kernel's values per block (their buckets: 4 KiB, in L1)


# ---------------------------------------------------------------------------------------------
# boundaries, lookup tables, many tensors at once

def zero_key(alpha: float, min_value: float) -> int:
    """key(min_value): keys at or below it are the zero bucket."""
    log_gamma = math.log1p(2.0 * alpha / (1.0 - alpha))
    return math.ceil(math.log(min_value) * (1.0 / log_gamma))


@lru_cache(maxsize=16)
def _table(alpha: float, min_value: float, top: float) -> torch.Tensor:
    log_gamma = math.log1p(2.0 * alpha / (1.0 - alpha))
    zk = zero_key(alpha, min_value)
    n = math.ceil(math.log(top) / log_gamma) - zk + 2
    return torch.exp((torch.arange(n, dtype=torch.float64) + zk) * log_gamma)


def boundary_table(alpha: float, min_value: float = 1e-30, max_abs: float = 0.0) -> torch.Tensor:
    """(J,) float64 bucket boundaries b[j] = gamma^(key(min_value) + j) on CPU, covering float32's
    range (and ``max_abs`` when larger); |ordinal(x)| = number of b[j] < |x| (the definition)."""
    top = _F32_MAX
    while top < max_abs and math.isfinite(max_abs):
        top = min(top * 1e30, float(torch.finfo(torch.float64).max))  # float64 inputs beyond float32
    return _table(float(alpha), float(min_value), top)


class _Lut:
    """Per-(alpha, min_value) lookup tables over float32 bits for the numba kernels: cell
    f = |bits| >> shift; ordinal = key[f] + (|x| > bound[f]); key[f] = -1 marks inf/NaN cells.
    ``zero_bound``: ordinal 0 iff not |x| > zero_bound."""

    def __init__(self, alpha: float, min_value: float):
        b = boundary_table(alpha, min_value)
        # cells finer than a bucket, so at most one boundary falls inside a cell
        mbits = max(1, math.ceil(-math.log2(min(b[1] / b[0] - 1.0, 1.0))) + 1)
        if mbits > 14:
            raise ConfigError(f"alpha={alpha} is too fine for the lookup-table kernel")
        self.shift = 23 - mbits
        cells = torch.arange(1 << (31 - self.shift), dtype=torch.int64)
        lo = (cells << self.shift).to(torch.int32).view(torch.float32).double()
        hi = (((cells + 1) << self.shift) - 1).to(torch.int32).view(torch.float32).double()
        k_lo, k_hi = torch.searchsorted(b, lo), torch.searchsorted(b, hi)
        finite = torch.isfinite(hi) & torch.isfinite(lo)
        assert bool(((k_hi - k_lo)[finite] <= 1).all())
        inside = (k_hi > k_lo) & finite
        bound = torch.full(cells.shape, math.inf, dtype=torch.float64)
        bound[inside] = b[k_lo[inside]]
        b32 = bound.to(torch.float32)                       # round to nearest, then down where it went up
        up = b32.double() > bound
        b32[up] = torch.nextafter(b32[up], torch.tensor(-math.inf))
        k_lo[~finite] = -1
        self.key = k_lo.to(torch.int32).numpy()
        self.bound = b32.numpy()
        z = np.float32(b[0])  # the zero bucket is |x| <= b[0]: as a float32 compare, rounded down too
        self.zero_bound = z if float(z) <= float(b[0]) else np.nextafter(z, np.float32(-np.inf))


@lru_cache(maxsize=16)
def lookup_table(alpha: float, min_value: float = 1e-30) -> _Lut:
    """The kernels' lookup tables for (alpha, min_value), built once (shift, key, bound; key.max()
    is the largest ordinal of a finite float32)."""
    return _Lut(alpha, min_value)


def fast(flat: torch.Tensor) -> bool:
    """Whether the numba kernels take this tensor (CPU float32 / float16 / bfloat16)."""
    return (HAVE_NUMBA and flat.device.type == "cpu"
            and flat.dtype in (torch.float32, torch.float16, torch.bfloat16))


def _f32_numpy(flat: torch.Tensor) -> np.ndarray:
    return flat.to(torch.float32).contiguous().numpy()


def ordinals(flat: torch.Tensor, alpha: float, min_value: float = 1e-30, name: str | None = None) -> torch.Tensor:
    """Signed bucket ordinal of every element of a flat float tensor (int64, same device): the
    numba kernel on CPU float32/16, else ``ordinals_reference``. Raises NonFiniteError on inf/NaN."""
    if not fast(flat):
        return ordinals_reference(flat, alpha, min_value, name)
    f32 = _f32_numpy(flat)
    t = lookup_table(float(alpha), float(min_value))
    out = np.empty(f32.size, dtype=np.int64)
    if _ordinals_kernel(f32.view(np.int32), f32, t.shift, t.key, t.bound, out):
        raise_nonfinite(flat, name)
    return torch.from_numpy(out)


def ordinals_reference(flat: torch.Tensor, alpha: float, min_value: float = 1e-30,
                       name: str | None = None) -> torch.Tensor:
    """Plain-torch reference: signed number of boundaries strictly below |x| (any device/dtype)."""
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        raise_nonfinite(flat, name)
    b = boundary_table(alpha, min_value, float(flat.abs().max()) if flat.numel() else 0.0).to(flat.device)
    out = torch.empty(flat.shape, dtype=torch.int64, device=flat.device)
    for s in range(0, flat.numel(), _CHUNK):
        d = flat[s:s + _CHUNK].to(torch.float64)
        o = torch.searchsorted(b, d.abs())
        out[s:s + _CHUNK] = torch.where(d < 0, -o, o)
    return out


def segment_histograms(flat: torch.Tensor, offsets, *, alpha: float = 0.01, min_value: float = 1e-30,
                       names: Sequence[str] | None = None, kinds: Sequence[str] = ("signed",)) -> tuple:
    """Sketch every segment ``flat[offsets[i]:offsets[i+1]]`` of one buffer, in one pass.

    Returns one (ords, counts, row_ptr) per entry of ``kinds``: "signed" (what
    ``LogSketch(alpha).add(segment)`` holds) or "abs" (``LogSketch(alpha).add(segment.abs())``,
    without computing |x|). Row i's sorted ordinals and their counts are
    ``ords[row_ptr[i]:row_ptr[i+1]]`` (and the same slice of ``counts``). One numba call for every
    segment on CPU; the plain-torch reference (per segment) elsewhere. NonFiniteError names the
    first segment with inf/NaN (by ``names[i]`` when given).
    """
    if not kinds or any(k not in ("signed", "abs") for k in kinds):
        raise ConfigError(f"segment_histograms kinds must be 'signed' and/or 'abs', got {kinds!r}")
    offs = torch.as_tensor(offsets, dtype=torch.int64).cpu()
    if not fast(flat):
        return tuple(_segment_histograms_ref(flat, offs, alpha, min_value, names, k == "abs") for k in kinds)
    t = lookup_table(float(alpha), float(min_value))
    f32 = _f32_numpy(flat.reshape(-1))
    o = offs.numpy()
    M = int(t.key.max())
    cap = row_capacity(o, M)
    outs = {k: (np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64), np.zeros(o.size, dtype=np.int64))
            for k in ("signed", "abs")}
    bad = _hist_kernel(f32.view(np.int32), f32, o, t.shift, t.key, t.bound, M, "signed" in kinds, "abs" in kinds,
                       *outs["signed"], *outs["abs"])
    if bad >= 0:
        seg = flat.reshape(-1)[int(o[bad]):int(o[bad + 1])]
        raise_nonfinite(seg, _seg_name(names, bad))
    res = []
    for k in kinds:
        ords, counts, ptr = outs[k]
        n = int(ptr[-1])
        res.append((torch.from_numpy(ords[:n]), torch.from_numpy(counts[:n]), torch.from_numpy(ptr)))
    return tuple(res)


def row_capacity(offsets: np.ndarray, M: int) -> int:
    """The ords / counts entries the emitted rows of the segments at ``offsets`` may need: a segment
    fills at most min(its size, 2 M + 1) cells, and emit_counts writes one entry past the last it
    keeps."""
    return int(np.minimum(np.diff(offsets), 2 * M + 1).sum()) + 1


def _seg_name(names, i: int) -> str:
    return names[i] if names is not None else f"segment {i}"


def _segment_histograms_ref(flat, offs, alpha, min_value, names, absolute=False):
    parts_o, parts_c, ptr = [], [], [0]
    flat = flat.reshape(-1)
    for i in range(offs.numel() - 1):
        seg = flat[int(offs[i]):int(offs[i + 1])]
        u = c = torch.zeros(0, dtype=torch.int64)
        if seg.numel():
            o = ordinals_reference(seg, alpha, min_value, _seg_name(names, i))
            u, c = torch.unique(o.abs() if absolute else o, sorted=True, return_counts=True)
        parts_o.append(u.cpu())
        parts_c.append(c.cpu())
        ptr.append(ptr[-1] + u.numel())
    return torch.cat(parts_o), torch.cat(parts_c), torch.tensor(ptr, dtype=torch.int64)


def raise_nonfinite(x: torch.Tensor, name: str | None):
    bad = int((~torch.isfinite(x)).sum())
    raise NonFiniteError(
        f"{name or 'tensor'} holds {bad} non-finite value(s) (inf/NaN) out of {x.numel()}; "
        f"a quantile sketch needs finite values: fix or drop them before compressing")


# ---------------------------------------------------------------------------------------------
# numba kernels (CPU float32); the reference is LogSketch._ordinals_ref

if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True, inline="always")
    def bucket_ordinal(bits, v, shift, key, bound):  # pragma: no cover - compiled
        """Signed ordinal of one float32 (bits: its int32 view); -2**31 for inf/NaN."""
        f = (bits & 0x7FFFFFFF) >> shift
        k = key[f]
        if k < 0:
            return -2147483648
        k += abs(v) > bound[f]
        return -k if bits < 0 else k

    @_numba.njit(cache=True, nogil=True)
    def _ordinals_kernel(bits, vals, shift, key, bound, out):  # pragma: no cover - compiled
        for i in range(bits.shape[0]):
            o = bucket_ordinal(bits[i], vals[i], shift, key, bound)
            if o == -2147483648:
                return True
            out[i] = o
        return False

    @_numba.njit(cache=True, nogil=True, inline="always")
    def bucket_fold(bits, v, shift, key, bound):  # pragma: no cover - compiled
        """2 |ordinal| + (sign bit) of one float32; negative for inf/NaN (key -1, and no value
        passes an inf/NaN cell's bound). Dense counts indexed by this span only the magnitudes
        present (signed ordinals would span the gap around zero too). No branch, an unsigned shift:
        a loop of it vectorizes."""
        f = np.uint32(bits & 0x7FFFFFFF) >> np.uint32(shift)
        return ((key[f] + (abs(v) > bound[f])) << 1) | ((bits >> 31) & 1)

    @_numba.njit(cache=True, nogil=True, inline="always")
    def fold_block(bits, vals, a, m, shift, key, bound, M, block):  # pragma: no cover - compiled
        """``bucket_fold`` of values a .. a + m - 1 into ``block``; (their least, their greatest):
        the least is negative where one is inf/NaN. Branch-free: the loop vectorizes."""
        blo, bhi = np.int32(2 * M + 1), np.int32(0)
        for t in range(m):
            j = bucket_fold(bits[a + t], vals[a + t], shift, key, bound)
            block[t] = j
            blo = min(blo, j)
            bhi = max(bhi, j)
        return blo, bhi

    @_numba.njit(cache=True, nogil=True)
    def _hist_kernel(bits, vals, offsets, shift, key, bound, M, signed, absolute, ords, counts, ptr,
                     a_ords, a_counts, a_ptr):  # pragma: no cover
        """Dense counts per segment, then its non-zero cells in ordinal order. Returns the first
        segment holding inf/NaN, or -1. A block's buckets first (bucket_fold: the loop vectorizes,
        unsigned indices and no stores to the counts in it), then its counts into four
        interleaved rows: consecutive values mostly hit the same bucket, and one row would
        serialise on its store-to-load dependency (1.6 -> 1.2 ns a value against one loop). The
        rows are summed into one before the cells are emitted (fold_rows)."""
        d = np.zeros((4, 2 * M + 2), dtype=np.int64)
        f = np.zeros(2 * M + 2, dtype=np.int64)
        block = np.empty(_BLOCK, np.int32)
        n = 0
        na = 0
        for s in range(offsets.shape[0] - 1):
            a, e = np.uint64(offsets[s]), np.uint64(offsets[s + 1])
            lo, hi = 2 * M + 1, 0
            while a < e:
                m = min(e - a, np.uint64(_BLOCK))
                blo, bhi = fold_block(bits, vals, a, m, shift, key, bound, M, block)
                if blo < 0:  # inf/NaN
                    return s
                for t in range(m):
                    d[t & np.uint64(3), np.uint64(block[t])] += 1
                lo = min(lo, blo)
                hi = max(hi, bhi)
                a += m
            fold_rows(d, lo, hi, f)
            if signed:
                n = emit_counts(f, lo, hi, False, not absolute, ords, counts, n)
                ptr[s + 1] = n
            if absolute:
                na = emit_counts(f, lo, hi, True, True, a_ords, a_counts, na)
                a_ptr[s + 1] = na
        return -1

    @_numba.njit(cache=True, nogil=True, inline="always")
    def fold_rows(d, lo, hi, f):  # pragma: no cover - compiled
        """f[j] = the sum of the four count rows d[:, j] over both signs' cells of ordinals
        lo >> 1 .. hi >> 1, those cells of d zeroed."""
        if hi < lo:
            return
        for j in range(np.uint64(lo & ~1), np.uint64((hi | 1) + 1)):
            f[j] = d[0, j] + d[1, j] + d[2, j] + d[3, j]
            d[0, j] = 0
            d[1, j] = 0
            d[2, j] = 0
            d[3, j] = 0

    @_numba.njit(cache=True, nogil=True)
    def emit_counts(f, lo, hi, absolute, zero, ords, counts, n):  # pragma: no cover - compiled
        """Append the non-zero cells of the folded counts f[lo..hi] (index 2|ordinal| + sign; both
        signs' cells of each ordinal read) to ords/counts from position n, in signed-ordinal
        order (or |ordinal| order when ``absolute``); then zero those cells if ``zero``. Returns
        the new n. Every cell is written at n and kept by stepping n (no branch on the counts,
        which a data-dependent branch mispredicts): ords/counts need one entry of room beyond
        the cells kept. Unsigned indices: numba tests a signed one for wraparound."""
        if hi < lo:
            return n
        klo, khi = np.uint64(lo >> 1), np.uint64(hi >> 1)
        one, two = np.uint64(1), np.uint64(2)
        u = np.uint64(n)
        if not absolute:
            k0 = max(klo, one)
            k = khi + one
            while k > k0:                                 # negative buckets, most negative first
                k -= one
                c = f[two * k + one]
                ords[u] = -np.int64(k)
                counts[u] = c
                u += np.uint64(c != 0)
        for k in range(klo, khi + one):                   # zero (both signs), then positive buckets
            j = two * k
            c = f[j]
            if absolute or k == 0:
                c += f[j + one]
            ords[u] = np.int64(k)
            counts[u] = c
            u += np.uint64(c != 0)
        if zero:
            for j in range(two * klo, two * khi + two):
                f[j] = 0
        return np.int64(u)

else:  # pragma: no cover
    bucket_ordinal = bucket_fold = fold_block = fold_rows = emit_counts = _ordinals_kernel = _hist_kernel = None
