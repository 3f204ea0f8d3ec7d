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

Quantile convention (the same as the ``ddsketch`` package): quantile(q) estimates the element of
rank floor(q * (n - 1)) in ascending order (numpy's ``method="lower"``), and returns its bucket's
representative, so |estimate - exact| <= alpha * |exact| for every q (|exact| > min_value).

Keys are computed in float64 so bucket boundaries are exact to ~1e-16; inputs of any float dtype
(float16, bfloat16, float32, float64) are read as float64 in chunks to bound memory.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ckptzip.errors import ConfigError, NonFiniteError

__all__ = ["LogSketch"]

FORMAT = "logsketch/1"
_CHUNK_CPU = 1 << 18   # elements per pass on CPU: the 2 MiB float64 temporaries stay in L2 (~2x vs 1M)
_CHUNK_CUDA = 1 << 25  # on GPU only memory matters


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
        self._inv_log_gamma = 1.0 / self._log_gamma
        self._zero_key = math.ceil(math.log(min_value) * self._inv_log_gamma)  # keys <= this are "zero"
        self._ord = torch.zeros(0, dtype=torch.int64)     # (B,) sorted signed bucket ordinals
        self._counts = torch.zeros(0, dtype=torch.int64)  # (B,) count per ordinal, all > 0

    # ------------------------------------------------------------------ building
    def ordinals(self, x: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Signed bucket ordinal of every element of ``x`` (int64, x's shape, x's device).

        Monotone in value: x <= y implies ordinal(x) <= ordinal(y). Raises NonFiniteError on inf/NaN.
        """
        x = _as_float_tensor(x, name)
        flat = x.reshape(-1)
        out = torch.empty(flat.shape, dtype=torch.int64, device=flat.device)
        step = _CHUNK_CUDA if flat.is_cuda else _CHUNK_CPU
        for s in range(0, flat.numel(), step):
            ordf = self._ordinals_f64(flat[s:s + step])
            _check_finite(ordf, x, name)
            out[s:s + step] = ordf.to(torch.int64)
        return out.reshape(x.shape)

    def _ordinals_f64(self, chunk: torch.Tensor) -> torch.Tensor:
        # float64 so keys are exact to ~1e-16 at bucket boundaries (float32 log would give ~1e-5
        # relative slack on the alpha bound). 0 -> log = -inf -> clamped to ordinal 0; inf/NaN
        # stay non-finite and are caught by the caller from the chunk's min/max.
        d = chunk.to(torch.float64, copy=True)
        k = d.abs().log_().mul_(self._inv_log_gamma).ceil_().sub_(self._zero_key).clamp_min_(0.0)
        return k.copysign_(d)  # in place: one float64 temporary fewer per chunk

    def add(self, x: torch.Tensor, name: str | None = None) -> "LogSketch":
        """Count every element of ``x`` (any float dtype, any device). Returns self.

        One vectorized pass per chunk: float64 log-keys, then a bincount over the chunk's key range.
        ``name`` is only used in the NonFiniteError message.
        """
        x = _as_float_tensor(x, name)
        flat = x.reshape(-1)
        if flat.numel() == 0:
            return self
        step = _CHUNK_CUDA if flat.is_cuda else _CHUNK_CPU
        parts_o, parts_c = [], []
        for s in range(0, flat.numel(), step):
            ordf = self._ordinals_f64(flat[s:s + step])
            lo, hi = _check_finite(ordf, x, name)
            counts = torch.bincount(ordf.sub_(lo).to(torch.int64), minlength=int(hi - lo) + 1)
            nz = counts.nonzero().squeeze(1)
            parts_o.append(nz + int(lo))
            parts_c.append(counts[nz])
        self._combine(torch.cat(parts_o), torch.cat(parts_c))
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


def _check_finite(ordf: torch.Tensor, x: torch.Tensor, name: str | None) -> tuple[float, float]:
    """(min, max) of a chunk's float ordinals; raises NonFiniteError if x holds inf/NaN."""
    if ordf.numel() == 0:
        return 0.0, 0.0
    lo, hi = (float(v) for v in torch.aminmax(ordf))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(
            f"{name or 'tensor'} holds {bad} non-finite value(s) (inf/NaN) out of {x.numel()}; "
            f"a quantile sketch needs finite values: fix or drop them before compressing")
    return lo, hi
