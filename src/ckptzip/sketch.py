"""LogSketch: a vectorized, mergeable DDSketch in plain torch (DynaQuant section 4.3, Algorithm 2).

Every value x goes into a log-spaced bucket

    key(x) = ceil(log_gamma |x|),   gamma = (1 + alpha) / (1 - alpha)

so bucket ``key`` holds |x| in (gamma^(key-1), gamma^key], and reporting its representative
2 * gamma^key / (gamma + 1) is within a relative error ``alpha`` of every value in it. Positive and
negative values get separate buckets; a third "zero" bucket holds exact zeros and every |x| at or
below ``min_value`` (rounded up to the bucket boundary gamma^ceil(log_gamma min_value)), because
log|x| is unbounded there; those values are reported as 0.0, the one place the relative bound does
not hold (default min_value 1e-30, far below any float32 weight or Adam moment that matters).

Like DynaQuant we skip DDSketch's bucket collapsing: a model's parameters span a few thousand
buckets at alpha = 1%, so the sketch stays small without it and is exact to merge.

Storage is sparse: a sorted int64 tensor of signed bucket *ordinals* plus an int64 count per
ordinal. The ordinal orders buckets by value (negative buckets first, most negative first, then the
zero bucket as ordinal 0, then positive buckets), so the histogram, quantiles and merges are plain
cumsum/searchsorted/index_add on two short tensors::

    ordinal = sign(x) * max(key(x) - key(min_value), 0)

Bucket boundaries are one float64 table per (alpha, min_value), b[j] = gamma^(key(min_value) + j),
and |ordinal| is *defined* as the number of boundaries below |x| (``searchsorted(b, |x|)``), so
every implementation agrees bit for bit: the plain-torch reference does exactly that searchsorted
(any device, any float dtype); on CPU a numba kernel reads float32 bits instead -- a lookup table
over the exponent and top mantissa bits gives the ordinal, and the one boundary that can fall
inside a table cell is a float32 compare (rounded down, so ``x > b32`` iff ``x > b``). One pass per
tensor, ~2 ns per value; float16 / bfloat16 are widened to float32 first (exact), float64 takes
the reference.

Quantile convention (the same as the ``ddsketch`` package): quantile(q) estimates the element of
rank floor(q * (n - 1)) in ascending order (numpy's ``method="lower"``), and returns its bucket's
representative, so |estimate - exact| <= alpha * |exact| for every q (|exact| > min_value).

Many tensors at once: ``segment_histograms(flat, offsets, ...)`` sketches every segment of one
concatenated buffer in one kernel call (the quantizer batches the small tensors of a checkpoint
this way) and returns them in compressed-row form; ``LogSketch.from_counts`` wraps one row.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from ckptzip.errors import ConfigError, NonFiniteError

try:  # optional fast path; the torch reference is always available
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["LogSketch", "segment_histograms", "boundary_table", "HAVE_NUMBA"]

FORMAT = "logsketch/1"
HAVE_NUMBA = _numba is not None
_F32_MAX = float(torch.finfo(torch.float32).max)
_CHUNK = 1 << 22  # reference path: elements per searchsorted (bounds float64 temporaries)


class LogSketch:
    """Mergeable relative-error quantile sketch and log histogram.

    Call order: ``add`` any number of tensors (and/or ``merge`` other sketches of the same alpha),
    then read ``quantile`` / ``histogram``. Counts live on the device of the first tensor added.

    >>> s = LogSketch(alpha=0.01).add(torch.randn(1000))
    >>> s.count
    1000
    """

    __hash__ = None  # mutable, defines __eq__

    def __init__(self, alpha: float = 0.01, *, min_value: float = 1e-30):
        alpha = float(alpha)
        min_value = float(min_value)
        if not 0.0 < alpha < 1.0:
            raise ConfigError(f"LogSketch alpha must be in (0, 1), got {alpha}; 0.01 means 1% relative error")
        if not (min_value > 0.0 and math.isfinite(min_value)):
            raise ConfigError(f"LogSketch min_value must be a positive finite float, got {min_value}")
        self.alpha = alpha
        self.min_value = min_value
        self.gamma = (1.0 + alpha) / (1.0 - alpha)
        self._log_gamma = math.log1p(2.0 * alpha / (1.0 - alpha))  # log(gamma), accurate for tiny alpha
        self._zero_key = _zero_key(alpha, min_value)     # keys <= this are "zero"
        self._ord = torch.zeros(0, dtype=torch.int64)     # (B,) sorted signed bucket ordinals
        self._counts = torch.zeros(0, dtype=torch.int64)  # (B,) count per ordinal, all > 0

    @classmethod
    def from_counts(cls, ords: torch.Tensor, counts: torch.Tensor, alpha: float = 0.01, *,
                    min_value: float = 1e-30, sorted_unique: bool = False) -> "LogSketch":
        """A sketch holding ``counts`` at signed ``ords`` (e.g. rows of :func:`segment_histograms`,
        concatenated to merge them). ``sorted_unique=True`` trusts that ords are sorted and distinct
        with counts > 0 (one row as returned) and skips the combine."""
        s = cls(alpha, min_value=min_value)
        if sorted_unique:
            s._ord, s._counts = ords.to(torch.int64), counts.to(torch.int64)
        else:
            s._combine(ords, counts)
        return s

    # ------------------------------------------------------------------ building
    def ordinals(self, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Signed bucket ordinal of every element of ``x`` (int64, x's shape, x's device).

        Monotone in value: x <= y implies ordinal(x) <= ordinal(y). Raises NonFiniteError on inf/NaN.
        """
        x = _as_float_tensor(x, name)
        flat = x.reshape(-1)
        if _fast(flat):
            f32 = _f32_numpy(flat)
            t = _lut(self.alpha, self.min_value)
            out = np.empty(f32.size, dtype=np.int64)
            if _ordinals_kernel(f32.view(np.int32), f32, t.shift, t.key, t.bound, out):
                _raise_nonfinite(x, name)
            return torch.from_numpy(out).reshape(x.shape)
        return self._ordinals_ref(flat, x, name).reshape(x.shape)

    def _ordinals_ref(self, flat: torch.Tensor, x: torch.Tensor, name: str | None) -> torch.Tensor:
        """Plain-torch reference: signed number of boundaries strictly below |x| (any device/dtype)."""
        if flat.numel() and not bool(torch.isfinite(flat).all()):
            _raise_nonfinite(x, name)
        b = boundary_table(self.alpha, self.min_value, float(flat.abs().max()) if flat.numel() else 0.0)
        b = b.to(flat.device)
        out = torch.empty(flat.shape, dtype=torch.int64, device=flat.device)
        for s in range(0, flat.numel(), _CHUNK):
            d = flat[s:s + _CHUNK].to(torch.float64)
            o = torch.searchsorted(b, d.abs())
            out[s:s + _CHUNK] = torch.where(d < 0, -o, o)
        return out

    def add(self, x: torch.Tensor, name: str | None = None) -> "LogSketch":
        """Count every element of ``x`` (any float dtype, any device). Returns self.

        CPU float16/bfloat16/float32: one numba pass (lookup table + dense count); otherwise the
        reference ordinals and a bincount. ``name`` is only used in the NonFiniteError message.
        """
        x = _as_float_tensor(x, name)
        flat = x.reshape(-1)
        if flat.numel() == 0:
            return self
        if _fast(flat):
            ords, counts, _ = segment_histograms(flat, [0, flat.numel()], alpha=self.alpha,
                                                 min_value=self.min_value, names=[name or "tensor"])
        else:
            o = self._ordinals_ref(flat, x, name)
            lo, hi = (int(v) for v in torch.aminmax(o))
            c = torch.bincount(o - lo, minlength=hi - lo + 1)
            nz = c.nonzero().squeeze(1)
            ords, counts = nz + lo, c[nz]
        ords, counts = ords.to(flat.device), counts.to(flat.device)
        if self._ord.numel():
            self._combine(ords, counts)
        else:  # already sorted and distinct
            self._ord, self._counts = ords, counts
        return self

    def merge(self, other: "LogSketch") -> "LogSketch":
        """Add ``other``'s counts into this sketch (in place; returns self).

        Exact: merge(sketch(a), sketch(b)) == sketch(cat(a, b)). Used across the tensors of one layer
        type and across ranks (via to_dict/from_dict). alpha and min_value must match.
        """
        if not isinstance(other, LogSketch):
            raise ConfigError(f"LogSketch.merge needs a LogSketch, got {type(other).__name__}")
        if other.alpha != self.alpha or other.min_value != self.min_value:
            raise ConfigError(
                f"cannot merge LogSketch(alpha={other.alpha}, min_value={other.min_value}) into "
                f"LogSketch(alpha={self.alpha}, min_value={self.min_value}); build both with the same alpha")
        if other._ord.numel():
            self._combine(other._ord, other._counts)
        return self

    def _combine(self, ords: torch.Tensor, counts: torch.Tensor) -> None:
        # union of sorted sparse stores by index_add over the joint ordinal range (int64: exact)
        if self._ord.numel():
            ords = torch.cat([self._ord, ords.to(self._ord.device)])
            counts = torch.cat([self._counts, counts.to(self._ord.device)])
        if ords.numel() == 0:
            return
        lo, hi = int(ords.min()), int(ords.max())
        dense = torch.zeros(hi - lo + 1, dtype=torch.int64, device=ords.device)
        dense.index_add_(0, ords - lo, counts.to(torch.int64))
        nz = dense.nonzero().squeeze(1)
        self._ord, self._counts = nz + lo, dense[nz]

    # ------------------------------------------------------------------ reading
    @property
    def count(self) -> int:
        """Number of values added (merged sketches included)."""
        return int(self._counts.sum()) if self._counts.numel() else 0

    @property
    def zero_count(self) -> int:
        """Values in the zero bucket (exact zeros and |x| <= ~min_value)."""
        m = self._ord == 0
        return int(self._counts[m].sum()) if bool(m.any()) else 0

    @property
    def num_buckets(self) -> int:
        """Non-empty buckets (negative + zero + positive)."""
        return int(self._ord.numel())

    @property
    def device(self) -> torch.device:
        return self._ord.device

    def ordinal_values(self, ords: torch.Tensor) -> torch.Tensor:
        """Bucket representative (float64) of each signed ordinal: ±2 gamma^key / (gamma + 1), 0 for 0."""
        ords = torch.as_tensor(ords)
        key = ords.abs().to(torch.float64) + self._zero_key
        mag = torch.exp(key * self._log_gamma) * (2.0 / (1.0 + self.gamma))
        return torch.where(ords == 0, torch.zeros_like(mag), torch.copysign(mag, ords.to(torch.float64)))

    def histogram(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(centers, counts) of the non-empty buckets, ascending by value.

        centers: (B,) float64 representatives (negative, 0.0 for the zero bucket, positive);
        counts: (B,) int64, summing to ``count``. Both on the sketch's device.
        """
        return self.ordinal_values(self._ord), self._counts.clone()

    def quantile(self, q: float | Sequence[float] | torch.Tensor) -> float | torch.Tensor:
        """Estimate of the value of rank floor(q * (count - 1)), within relative error alpha.

        q: a float in [0, 1] -> float; a list/tensor of them -> float64 tensor of q's shape (on the
        sketch's device), all answered with one cumsum and one searchsorted. An empty sketch gives NaN.
        """
        scalar = isinstance(q, (int, float))
        if scalar and 0.0 <= q <= 1.0 and self._counts.numel():  # one value: skip the tensor setup
            cum = torch.cumsum(self._counts, 0)
            n = int(cum[-1])
            pos = min(int(torch.searchsorted(cum, math.floor(q * (n - 1)), right=True)), cum.numel() - 1)
            return float(self.ordinal_values(self._ord[pos:pos + 1])[0])
        qt = torch.as_tensor(q, dtype=torch.float64).to(self.device)
        if qt.numel() and not bool(((qt >= 0) & (qt <= 1)).all()):
            raise ConfigError(f"quantile q must be in [0, 1], got {q}")
        n = self.count
        if n == 0:
            out = torch.full(qt.shape, float("nan"), dtype=torch.float64, device=self.device)
        else:
            rank = torch.floor(qt * (n - 1)).to(torch.int64)
            cum = torch.cumsum(self._counts, 0)
            pos = torch.searchsorted(cum, rank.reshape(-1), right=True).clamp_(max=cum.numel() - 1)
            out = self.ordinal_values(self._ord[pos]).reshape(qt.shape)
        return float(out) if scalar else out

    def bucket_index(self, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Position of each element's bucket in ``histogram()`` (int64, x's shape).

        So ``histogram()[0][sketch.bucket_index(x)]`` is x rounded to its bucket representative.
        Raises ConfigError if some element's bucket was never added to this sketch.
        """
        o = self.ordinals(x, name).to(self.device)
        pos = torch.searchsorted(self._ord, o.reshape(-1)).clamp_(max=max(self._ord.numel() - 1, 0))
        if self._ord.numel() == 0 or not bool((self._ord[pos] == o.reshape(-1)).all()):
            raise ConfigError(f"{name or 'tensor'} has values in buckets this sketch never saw; add() it first")
        return pos.reshape(o.shape)

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict:
        """JSON-able form (for manifests and all-gather): raw DDSketch keys, per sign."""
        ords = self._ord.cpu()
        counts = self._counts.cpu()
        pos, neg = ords > 0, ords < 0
        return {
            "format": FORMAT,
            "alpha": self.alpha,
            "min_value": self.min_value,
            "zero_count": int(counts[ords == 0].sum()),
            "positive": {"keys": (ords[pos] + self._zero_key).tolist(), "counts": counts[pos].tolist()},
            "negative": {"keys": (-ords[neg] + self._zero_key).tolist(), "counts": counts[neg].tolist()},
        }

    @classmethod
    def from_dict(cls, d: dict, device: torch.device | str | None = None) -> "LogSketch":
        """Inverse of to_dict (counts placed on ``device``, default CPU)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ConfigError(f"not a {FORMAT} dict (format={d.get('format') if isinstance(d, dict) else None!r})")
        s = cls(d["alpha"], min_value=d["min_value"])
        pk = torch.tensor(d["positive"]["keys"], dtype=torch.int64)
        nk = torch.tensor(d["negative"]["keys"], dtype=torch.int64)
        pc = torch.tensor(d["positive"]["counts"], dtype=torch.int64)
        nc = torch.tensor(d["negative"]["counts"], dtype=torch.int64)
        zc = int(d["zero_count"])
        if pk.numel() != pc.numel() or nk.numel() != nc.numel() or zc < 0 or bool((pc <= 0).any()) \
                or bool((nc <= 0).any()) or bool((pk <= s._zero_key).any()) or bool((nk <= s._zero_key).any()):
            raise ConfigError(f"malformed {FORMAT} dict: keys/counts mismatch or out of range")
        ords = torch.cat([-(nk - s._zero_key), torch.zeros(1 if zc else 0, dtype=torch.int64), pk - s._zero_key])
        counts = torch.cat([nc, torch.tensor([zc] if zc else [], dtype=torch.int64), pc])
        if device is not None:
            ords, counts = ords.to(device), counts.to(device)
        s._combine(ords, counts)  # sorts, and merges repeated keys
        return s

    def copy(self) -> "LogSketch":
        s = LogSketch(self.alpha, min_value=self.min_value)
        s._ord, s._counts = self._ord.clone(), self._counts.clone()
        return s

    def to(self, device: torch.device | str) -> "LogSketch":
        """Move the counts to ``device`` (in place; returns self)."""
        self._ord, self._counts = self._ord.to(device), self._counts.to(device)
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LogSketch):
            return NotImplemented
        return (self.alpha == other.alpha and self.min_value == other.min_value
                and torch.equal(self._ord.cpu(), other._ord.cpu())
                and torch.equal(self._counts.cpu(), other._counts.cpu()))

    def __repr__(self) -> str:
        return f"LogSketch(alpha={self.alpha}, count={self.count}, buckets={self.num_buckets})"


# ---------------------------------------------------------------------------------------------
# boundaries, lookup tables, many tensors at once

def _zero_key(alpha: float, min_value: float) -> int:
    log_gamma = math.log1p(2.0 * alpha / (1.0 - alpha))
    return math.ceil(math.log(min_value) * (1.0 / log_gamma))


@lru_cache(maxsize=16)
def _table(alpha: float, min_value: float, top: float) -> torch.Tensor:
    log_gamma = math.log1p(2.0 * alpha / (1.0 - alpha))
    zk = _zero_key(alpha, min_value)
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
    f = |bits| >> shift; ordinal = key[f] + (|x| > bound[f]); key[f] = -1 marks inf/NaN cells."""

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


@lru_cache(maxsize=16)
def _lut(alpha: float, min_value: float) -> _Lut:
    return _Lut(alpha, min_value)


def _fast(flat: torch.Tensor) -> bool:
    return (HAVE_NUMBA and flat.device.type == "cpu"
            and flat.dtype in (torch.float32, torch.float16, torch.bfloat16))


def _f32_numpy(flat: torch.Tensor) -> np.ndarray:
    return flat.to(torch.float32).contiguous().numpy()


def segment_histograms(flat: torch.Tensor, offsets, *, alpha: float = 0.01, min_value: float = 1e-30,
                       names: Sequence[str] | None = None, absolute: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sketch every segment ``flat[offsets[i]:offsets[i+1]]`` of one buffer: (ords, counts, row_ptr).

    Row i's sorted signed ordinals and their counts are ``ords[row_ptr[i]:row_ptr[i+1]]`` (and the
    same slice of ``counts``): what ``LogSketch(alpha).add(segment)`` holds. One numba call for
    every segment on CPU; the plain-torch reference (per segment) elsewhere. NonFiniteError names
    the first segment with inf/NaN (by ``names[i]`` when given). ``absolute``: sketch |x| instead
    (what ``LogSketch.add(segment.abs())`` holds), without computing |x|.
    """
    offs = torch.as_tensor(offsets, dtype=torch.int64).cpu()
    if not _fast(flat):
        return _segment_histograms_ref(flat, offs, alpha, min_value, names, absolute)
    t = _lut(float(alpha), float(min_value))
    f32 = _f32_numpy(flat.reshape(-1))
    o = offs.numpy()
    M = int(t.key.max())
    cap = int(np.minimum(np.diff(o), 2 * M + 1).sum())
    ords = np.empty(cap, dtype=np.int64)
    counts = np.empty(cap, dtype=np.int64)
    ptr = np.zeros(o.size, dtype=np.int64)
    bad = _hist_kernel(f32.view(np.int32), f32, o, t.shift, t.key, t.bound, M, absolute, ords, counts, ptr)
    if bad >= 0:
        seg = flat.reshape(-1)[int(o[bad]):int(o[bad + 1])]
        _raise_nonfinite(seg, _seg_name(names, bad))
    n = int(ptr[-1])
    return torch.from_numpy(ords[:n]), torch.from_numpy(counts[:n]), torch.from_numpy(ptr)


def _seg_name(names, i: int) -> str:
    return names[i] if names is not None else f"segment {i}"


def _segment_histograms_ref(flat, offs, alpha, min_value, names, absolute=False):
    sk = LogSketch(alpha, min_value=min_value)
    parts_o, parts_c, ptr = [], [], [0]
    flat = flat.reshape(-1)
    for i in range(offs.numel() - 1):
        seg = flat[int(offs[i]):int(offs[i + 1])]
        s = LogSketch(alpha, min_value=min_value)
        if seg.numel():
            o = sk._ordinals_ref(seg, seg, _seg_name(names, i))
            u, c = torch.unique(o.abs() if absolute else o, sorted=True, return_counts=True)
            s._ord, s._counts = u, c
        parts_o.append(s._ord.cpu())
        parts_c.append(s._counts.cpu())
        ptr.append(ptr[-1] + s._ord.numel())
    return torch.cat(parts_o), torch.cat(parts_c), torch.tensor(ptr, dtype=torch.int64)


def _as_float_tensor(x, name: str | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if not x.is_floating_point():
        raise ConfigError(f"{name or 'tensor'} must be a float tensor, got {x.dtype}")
    return x.detach()


def _raise_nonfinite(x: torch.Tensor, name: str | None):
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
        """2 |ordinal| + (sign bit) of one float32; -1 for inf/NaN. Dense counts indexed by this
        span only the magnitudes present (signed ordinals would span the gap around zero too)."""
        f = (bits & 0x7FFFFFFF) >> shift
        k = key[f]
        if k < 0:
            return -1
        k += abs(v) > bound[f]
        return (k << 1) | ((bits >> 31) & 1)

    @_numba.njit(cache=True, nogil=True)
    def _hist_kernel(bits, vals, offsets, shift, key, bound, M, absolute, ords, counts, ptr):  # pragma: no cover
        """Dense counts per segment, then its non-zero cells in ordinal order. Returns the first
        segment holding inf/NaN, or -1. Four interleaved count rows: consecutive values mostly hit
        the same bucket, and one row would serialise on its store-to-load dependency (2.3x slower)."""
        d = np.zeros((4, 2 * M + 2), dtype=np.int64)
        n = 0
        for s in range(offsets.shape[0] - 1):
            a, e = offsets[s], offsets[s + 1]
            lo, hi = 2 * M + 1, 0
            i = a
            while i + 4 <= e:
                j0 = bucket_fold(bits[i], vals[i], shift, key, bound)
                j1 = bucket_fold(bits[i + 1], vals[i + 1], shift, key, bound)
                j2 = bucket_fold(bits[i + 2], vals[i + 2], shift, key, bound)
                j3 = bucket_fold(bits[i + 3], vals[i + 3], shift, key, bound)
                m = min(min(j0, j1), min(j2, j3))
                if m < 0:
                    return s
                d[0, j0] += 1
                d[1, j1] += 1
                d[2, j2] += 1
                d[3, j3] += 1
                lo = min(lo, m)
                hi = max(hi, max(max(j0, j1), max(j2, j3)))
                i += 4
            while i < e:
                j0 = bucket_fold(bits[i], vals[i], shift, key, bound)
                if j0 < 0:
                    return s
                d[0, j0] += 1
                lo = min(lo, j0)
                hi = max(hi, j0)
                i += 1
            n = emit_counts(d, lo, hi, absolute, ords, counts, n)
            ptr[s + 1] = n
        return -1

    @_numba.njit(cache=True, nogil=True)
    def emit_counts(d, lo, hi, absolute, ords, counts, n):  # pragma: no cover - compiled
        """Append the non-zero cells of folded count rows d[:, lo..hi] (index 2|ordinal| + sign) to
        ords/counts from position n, in signed-ordinal order (or |ordinal| order when ``absolute``);
        zero those cells. Returns the new n."""
        if hi < lo:
            return n
        klo, khi = lo >> 1, hi >> 1
        if not absolute:
            for k in range(khi, max(klo, 1) - 1, -1):    # negative buckets, most negative first
                j = 2 * k + 1
                c = d[0, j] + d[1, j] + d[2, j] + d[3, j]
                if c:
                    ords[n] = -k
                    counts[n] = c
                    n += 1
        for k in range(klo, khi + 1):                     # zero (both signs), then positive buckets
            j = 2 * k
            c = d[0, j] + d[1, j] + d[2, j] + d[3, j]
            if absolute or k == 0:
                c += d[0, j + 1] + d[1, j + 1] + d[2, j + 1] + d[3, j + 1]
            if c:
                ords[n] = k
                counts[n] = c
                n += 1
        for j in range(2 * klo, 2 * khi + 2):
            d[0, j] = 0
            d[1, j] = 0
            d[2, j] = 0
            d[3, j] = 0
        return n

else:  # pragma: no cover
    bucket_ordinal = bucket_fold = emit_counts = _ordinals_kernel = _hist_kernel = None
