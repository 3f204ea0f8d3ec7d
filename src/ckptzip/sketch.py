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
and |ordinal| is *defined* as the number of boundaries below |x| (logbuckets.py): the plain-torch
reference does exactly that searchsorted (any device, any float dtype); on CPU a numba kernel over
float32 bits gives the same ordinals bit for bit, one pass at ~3 ns per value (float16 / bfloat16
are widened to float32 first, exactly; float64 takes the reference).

Quantile convention (the same as the ``ddsketch`` package): quantile(q) estimates the element of
rank floor(q * (n - 1)) in ascending order (numpy's ``method="lower"``), and returns its bucket's
representative, so |estimate - exact| <= alpha * |exact| for every q (|exact| > min_value).

Many tensors at once: ``segment_histograms(flat, offsets, ...)`` (logbuckets.py) sketches every
segment of one concatenated buffer in one kernel call (the quantizer batches the tensors of a
checkpoint this way) and returns them in compressed-row form; ``LogSketch.from_counts`` wraps one.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ckptzip.errors import ConfigError
from ckptzip.logbuckets import HAVE_NUMBA, ordinals, segment_histograms, zero_key

__all__ = ["LogSketch", "segment_histograms", "HAVE_NUMBA"]

FORMAT = "logsketch/1"
_MAGNITUDES: dict[tuple[float, float], torch.Tensor] = {}  # LogSketch._magnitudes's tables
_TABLE_LIMIT = 1 << 16  # float32's whole range is ~8,000 ordinals at alpha 1 %; float64's can exceed this


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
        self._zero_key = zero_key(alpha, min_value)     # keys <= this are "zero"
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
        return ordinals(x.reshape(-1), self.alpha, self.min_value, name).reshape(x.shape)

    def add(self, x: torch.Tensor, name: str | None = None) -> "LogSketch":
        """Count every element of ``x`` (any float dtype, any device). Returns self.

        CPU float16/bfloat16/float32: one numba pass (lookup table + dense count); otherwise the
        reference ordinals (logbuckets.py). ``name`` is only used in the NonFiniteError message.
        """
        x = _as_float_tensor(x, name)
        flat = x.reshape(-1)
        if flat.numel() == 0:
            return self
        (ords, counts, _), = segment_histograms(flat, [0, flat.numel()], alpha=self.alpha,
                                                min_value=self.min_value, names=[name or "tensor"])
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
        # a few thousand values: the host's exp, so a CUDA sketch answers the CPU's bits; numpy's
        # calls on them cost a fraction of torch's (several a save)
        host = ords.cpu().numpy()
        mags = np.abs(host)
        top = int(mags.max()) if mags.size else 0
        mag = self._magnitudes(top).numpy()[mags] if top < _TABLE_LIMIT else \
            self._magnitude(torch.from_numpy(mags)).numpy()
        return torch.from_numpy(np.asarray(np.copysign(mag, host.astype(np.float64)))).to(ords.device)

    def _value(self, ordinal: int) -> float:
        """``ordinal_values`` of one ordinal, as a float (math.copysign is IEEE copysign, as torch's)."""
        m = abs(ordinal)
        mag = self._magnitudes(m)[m] if m < _TABLE_LIMIT else self._magnitude(torch.tensor([m]))[0]
        return math.copysign(float(mag), ordinal)

    def _magnitude(self, mags: torch.Tensor) -> torch.Tensor:
        """2 gamma^key / (gamma + 1) of each |ordinal| (int64, CPU), key = |ordinal| + the zero key;
        0.0 for ordinal 0. float64 ``torch.exp`` gives an element the same bits wherever it sits."""
        out = torch.exp((mags.to(torch.float64) + self._zero_key) * self._log_gamma) * (2.0 / (1.0 + self.gamma))
        return out.masked_fill_(mags == 0, 0.0)

    def _magnitudes(self, top: int) -> torch.Tensor:
        """``_magnitude`` of 0..top and beyond, computed once per (alpha, min_value): a save reads a
        few thousand representatives in several calls, each an exp over all of them otherwise."""
        key = (self.alpha, self.min_value)
        table = _MAGNITUDES.get(key)
        if table is None or table.numel() <= top:
            table = _MAGNITUDES[key] = self._magnitude(torch.arange(max(2 * top + 1, 4096)))
        return table

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
            if self._counts.device.type == "cpu":  # numpy's cumsum and search: a few us, torch's calls ~10x
                cum = np.cumsum(self._counts.numpy())
                pos = int(np.searchsorted(cum, math.floor(q * (int(cum[-1]) - 1)), side="right"))
                return self._value(int(self._ord.numpy()[min(pos, cum.size - 1)]))
            cum = torch.cumsum(self._counts, 0)
            pos = int(torch.searchsorted(cum, math.floor(q * (int(cum[-1]) - 1)), right=True))
            return self._value(int(self._ord[min(pos, cum.numel() - 1)]))
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

    def ordinal_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted signed bucket ordinals, counts), both int64: the sparse store, e.g. for a dense
        all-reduce across ranks (dist.all_reduce_sketches). Copies."""
        return self._ord.clone(), self._counts.clone()

    @classmethod
    def from_ordinal_counts(cls, alpha: float, ordinals: torch.Tensor, counts: torch.Tensor, *,
                            min_value: float = 1e-30) -> "LogSketch":
        """Inverse of ordinal_counts (repeated ordinals are summed, zero counts dropped)."""
        s = cls(alpha, min_value=min_value)
        keep = counts > 0
        s._combine(ordinals[keep].to(torch.int64), counts[keep].to(torch.int64))
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




def _as_float_tensor(x, name: str | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if not x.is_floating_point():
        raise ConfigError(f"{name or 'tensor'} must be a float tensor, got {x.dtype}")
    return x.detach()
