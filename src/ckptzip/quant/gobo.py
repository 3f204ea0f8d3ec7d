"""GOBO's outlier-split k-means quantizer with L1 distance (the paper's "KMeans" baseline, GOBO+).

Inshrinkerator §8.2: "Naive K-Means non-uniform quantization with L1 distance used in GOBO"; A.2:
run inside training (GOBO is post-training) "with a soft termination condition which significantly
reduces the runtime". Search space, Table 12: bins {8..256}, bins for embedding layers {16, 32},
outlier threshold -4, max iteration 1000.

Per tensor (Zadeh et al. 2020, GOBO):
  1. Outliers. Fit a Gaussian N(mu, sigma) to the tensor (mean, population std). A value whose
     log-density log N(x; mu, sigma) = -z^2/2 - log(sigma) - log(2 pi)/2 is below
     ``outlier_log_prob`` (-4) is an outlier and is kept exactly (fp32, fp64 for fp64 input) in
     ``side["outliers"]``, in flat order. Note the threshold is on the *density*, as in GOBO, so the
     |z| cut depends on sigma: |z| > sqrt(2 (4 - log(sigma sqrt(2 pi)))), about 3.6 for BERT-like
     sigma = 0.04 and 6.5 for sigma = 1e-8; a tensor with sigma > e^4 / sqrt(2 pi) (~22) would be
     all outliers. A constant tensor (sigma = 0) has none.
  2. The rest: 1-D k-means with L1 distance, i.e. k-medians: assign each value to its nearest
     centre (in 1-D the same under L1 and L2), move each centre to the median of its cluster
     (the L1-optimal centre; the mean of the two middle values for an even count). Centres start
     linearly spaced over [min, max] of the inliers (GOBO's initialization; ``init="quantile"``
     starts them at the (j + 0.5)/k quantiles instead). An empty cluster keeps its centre.
  3. Termination: at most ``max_iter`` iterations; stop early when the total L1 error decreases by
     no more than ``rel_tol`` of its previous value (the soft termination of A.2; k-medians never
     increases it) or when no centre moves.

Implementation: sort the inliers once. Centres stay sorted, so every cluster is a contiguous run
of the sorted values between searchsorted(midpoints) boundaries; medians are index lookups and
the L1 error comes from prefix sums, so one iteration costs O(k log n), not O(n k).

Output layout (QuantizedTensor):
    codes    = cluster index 0..k-1 (centres ascending), and k for an outlier (a dedicated level,
               like DynaQuant's protected level); the outlier positions are the codes == k
    n_levels = k + 1 (always, even with no outliers, so a tensor's level count stays stable)
    codebook = (k + 1,) fp32: the centres, then NaN for the outlier level
    side     = {"outliers": values at codes == k, in flat order}

Call order::

    q = quantize(x, GoboConfig(bins=16))              # embedding=True uses embedding_bins
    y = dequantize(q)                                  # x's shape and dtype
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError, CorruptCheckpointError
from ..tensorbytes import dtype_name, torch_dtype
from .base import MIN_NUMEL, MIN_NUMEL_RANGE, QuantizedTensor, flat_float32

DESCRIPTOR = "gobo-kmedians/1"
_MAX_LEVELS = 1 << 16
_INITS = ("linear", "quantile")

# Paper Table 12 (GOBO+).
SEARCH_SPACE: dict[str, tuple] = {
    "bins": (8, 16, 32, 64, 128, 256),
    "embedding_bins": (16, 32),
    "outlier_log_prob": (-4.0,),
    "max_iter": (1000,),
}


@dataclass(frozen=True)
class GoboConfig:
    bins: int = 8                   # clusters for ordinary tensors (Table 12; GOBO's 3 bits)
    embedding_bins: int = 16        # clusters for embedding tables (Table 12)
    outlier_log_prob: float = -4.0  # Gaussian log-density below which a value is kept exactly (Table 12)
    max_iter: int = 1000            # iteration cap (Table 12)
    rel_tol: float = 1e-4           # soft termination: stop once the L1 error falls by <= rel_tol relative
    init: str = "linear"            # "linear" (GOBO) or "quantile" centre initialization
    min_numel: int = MIN_NUMEL      # methods keep smaller tensors exact

    def __post_init__(self):
        bins = Range(ge=1, le=_MAX_LEVELS - 1)
        check_fields(self, bins=bins, embedding_bins=bins, min_numel=MIN_NUMEL_RANGE,
                     outlier_log_prob=Range(gt=-math.inf, lt=math.inf, note=" (GOBO uses -4)"),
                     max_iter=Range(ge=0), rel_tol=Range(ge=0, lt=1, note=" (0 runs to convergence)"),
                     init=OneOf(_INITS))


# --------------------------------------------------------------------------- quantize / dequantize
def quantize(x: torch.Tensor, config: GoboConfig = GoboConfig(), *, embedding: bool = False) -> QuantizedTensor:
    """Outlier split, then 1-D L1 k-means on the rest; ``embedding`` picks ``embedding_bins``."""
    if not isinstance(config, GoboConfig):
        raise ConfigError(f"config must be a GoboConfig, got {type(config).__name__}")
    xf = flat_float32(x, "gobo")  # (n,)
    k = config.embedding_bins if embedding else config.bins
    mask, mean, std = gaussian_outliers(xf, config.outlier_log_prob)  # (n,) bool
    centers, n_iter, l1 = kmeans_l1_1d(xf[~mask], k, max_iter=config.max_iter, rel_tol=config.rel_tol,
                                       init=config.init)
    codes = torch.searchsorted((centers[:-1] + centers[1:]) / 2, xf)  # (n,): #midpoints < x
    codes = torch.where(mask, torch.full_like(codes, k), codes)
    keep = torch.promote_types(x.dtype, torch.float32)  # fp32 holds bf16/fp16/fp32 exactly
    outliers = x.detach().reshape(-1)[mask].to(keep)
    codebook = torch.cat([centers, centers.new_full((1,), float("nan"))])
    return QuantizedTensor(
        codes=codes, n_levels=k + 1, codebook=codebook, shape=tuple(x.shape), dtype=dtype_name(x.dtype),
        side={"outliers": outliers},
        meta={"descriptor": DESCRIPTOR, "bins": k, "mean": mean, "std": std,
              "outlier_log_prob": float(config.outlier_log_prob), "n_outliers": int(outliers.numel()),
              "iterations": n_iter, "l1_error": l1},
    )


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Centres for codes < k, the stored outliers (in flat order) for code k; x's shape and dtype."""
    k = q.n_levels - 1
    work = torch.float64 if q.dtype == "float64" else torch.float32
    values = q.codebook.to(work).clone()
    values[k] = 0.0  # the NaN placeholder; those positions are overwritten below
    y = values[q.codes.long()]  # codes may be narrow (uint8): index, never mask
    out = q.side["outliers"]
    mask = q.codes == k
    if int(mask.sum()) != out.numel():
        raise CorruptCheckpointError(f"gobo: {int(mask.sum())} outlier codes but {out.numel()} stored outliers")
    y[mask] = out.to(work)
    return y.reshape(q.shape).to(torch_dtype(q.dtype))


# --------------------------------------------------------------------------- outliers
def gaussian_outliers(xf: torch.Tensor, log_prob_threshold: float):
    """(mask, mean, std): mask marks values with log N(x; mean, std) < threshold (none if std == 0)."""
    if xf.numel() == 0:
        return torch.zeros_like(xf, dtype=torch.bool), 0.0, 0.0
    xd = xf.to(torch.float64)
    mean, std = float(xd.mean()), float(xd.std(unbiased=False))
    if not std > 0.0:
        return torch.zeros_like(xf, dtype=torch.bool), mean, std
    z = (xd - mean) / std
    log_p = -0.5 * z * z - (math.log(std) + 0.5 * math.log(2 * math.pi))
    return log_p < log_prob_threshold, mean, std


# --------------------------------------------------------------------------- 1-D L1 k-means
def kmeans_l1_1d(v: torch.Tensor, k: int, *, max_iter: int = 1000, rel_tol: float = 1e-4,
                 init: str = "linear"):
    """k-medians of a 1-D fp32 tensor. Returns (centres (k,) fp32 ascending, iterations, total L1).

    Cluster j is {x : m_{j-1} < x <= m_j} with m the midpoints of consecutive centres, which is
    what ``torch.searchsorted(m, x)`` assigns.
    """
    if v.numel() == 0:
        return torch.zeros(k, dtype=torch.float32, device=v.device), 0, 0.0
    xs = torch.sort(v.to(torch.float32)).values  # (n,)
    n = xs.numel()
    prefix = torch.zeros(n + 1, dtype=torch.float64, device=xs.device)
    torch.cumsum(xs.to(torch.float64), 0, out=prefix[1:])
    if init == "linear":
        c = torch.linspace(0.0, 1.0, k, dtype=torch.float32, device=xs.device) * (xs[-1] - xs[0]) + xs[0]
    else:
        idx = ((torch.arange(k, dtype=torch.float64, device=xs.device) + 0.5) * n / k).long().clamp_(0, n - 1)
        c = xs[idx]
    prev = math.inf
    it = 0
    for it in range(1, max_iter + 1):
        s, e = _segments(xs, c)
        l1 = _l1_error(xs, prefix, c, s, e)
        if it > 1 and prev - l1 <= rel_tol * prev:  # soft termination: the L1 error stopped falling
            break
        prev = l1
        lo_mid = ((s + e - 1) // 2).clamp(0, n - 1)
        hi_mid = ((s + e) // 2).clamp(0, n - 1)
        new = torch.where(e > s, (xs[lo_mid] + xs[hi_mid]) / 2, c)  # median; an empty cluster stays
        if torch.equal(new, c):
            break
        c = new
    l1 = _l1_error(xs, prefix, c, *_segments(xs, c))  # of the centres returned
    return c, it, float(l1)


def _segments(xs: torch.Tensor, c: torch.Tensor):
    """(start, end) int64 (k,) of each cluster's run in the sorted values xs."""
    b = torch.searchsorted(xs, (c[:-1] + c[1:]) / 2, right=True)  # (k-1,): #xs <= m_j
    zero = b.new_zeros(1)
    return torch.cat([zero, b]), torch.cat([b, zero + xs.numel()])


def _l1_error(xs, prefix, c, s, e) -> float:
    """sum_j sum_{x in run j} |x - c_j| from prefix sums (float64)."""
    p = torch.searchsorted(xs, c).clamp(min=s).minimum(e)  # split of run j into x < c_j and x >= c_j
    cd = c.to(torch.float64)
    left = cd * (p - s) - (prefix[p] - prefix[s])
    right = (prefix[e] - prefix[p]) - cd * (e - p)
    return float((left + right).sum())
