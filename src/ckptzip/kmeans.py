"""Approximate 1-D k-means on a log-sketch histogram (DynaQuant section 4.4, Algorithms 1 and 3).

Instead of clustering n raw parameters, cluster the B non-empty buckets of a LogSketch (B is a few
thousand at alpha = 1% whatever n is): the bucket representatives are the points, and each bucket
gets the sample weight (Algorithm 1, lines 2-3)

    w_i = sigma * count_i / sum(count) + (1 - sigma) * |center_i| / sum(|center|)

Normalization choice (the paper only says "Normalize"): both terms are divided by their sum, so
each is a distribution over buckets and sigma is the share of total weight that follows frequency.
sigma = 1 is plain k-means on the (alpha-rounded) data. Because log buckets are ~1/|x| dense, the
magnitude term gives every stretch of the value range about the same weight, so sigma -> 0 tends
to uniform resolution over the range and protects the rare large weights (paper: sigma = 0.2).

Clustering is weighted k-means++ seeding (Algorithm 3, D^2 sampling times the weight, with a
seeded torch.Generator) followed by weighted Lloyd iterations. Two cheap departures from the
paper, both switchable back: each seeding step keeps the best of 2 + ln(k) sampled candidates
("greedy k-means++", scikit-learn's default; ``n_local_trials=1`` is Algorithm 3 verbatim), and the
best of ``n_init=3`` seedings is kept (``n_init=1`` is the paper). On the B-point problem they
cost milliseconds and remove the 1.1-1.3x MSE outliers a single plain seeding hits at k >= 8 on
real Adam moments.

In 1-D the clusters are contiguous runs of sorted points, so one Lloyd step is a searchsorted of
the k-1 midpoints into the sorted points plus prefix sums: O(k log B) per iteration; assignment of
raw values to centers (``assign``) is exact nearest-center via searchsorted on midpoints, O(n log k).

The tiny B-point problem runs on CPU in float64 whatever the input device, so results are
deterministic for a seed and identical across devices; centers come back float32 on the input's
device.
"""
from __future__ import annotations

import math

import torch

from ckptzip.errors import ConfigError, NonFiniteError
from ckptzip.sketch import LogSketch

__all__ = ["approx_kmeans", "approx_kmeans_from_sketch", "assign", "weighted_kmeans_1d", "bucket_weights"]


def approx_kmeans(values: torch.Tensor, k: int, *, alpha: float = 0.01, sigma: float = 0.2, seed: int = 0,
                  max_iter: int = 100, tol: float = 1e-7, n_init: int = 3, n_local_trials: int | None = None,
                  name: str | None = None) -> torch.Tensor:
    """Algorithm 1: sketch ``values`` with LogSketch(alpha), then cluster the buckets into k centers.

    Returns a (m,) float32 tensor sorted ascending on values' device, m = min(k, non-empty buckets).
    """
    _check_args(k, sigma, max_iter, tol)
    values = torch.as_tensor(values)
    sketch = LogSketch(alpha).add(values, name=name)
    return approx_kmeans_from_sketch(sketch, k, sigma=sigma, seed=seed, max_iter=max_iter, tol=tol,
                                     n_init=n_init, n_local_trials=n_local_trials).to(values.device)


def approx_kmeans_from_sketch(sketch: LogSketch, k: int, *, sigma: float = 0.2, seed: int = 0,
                              max_iter: int = 100, tol: float = 1e-7, n_init: int = 3,
                              n_local_trials: int | None = None) -> torch.Tensor:
    """Algorithm 1 from an already built (e.g. merged across a layer type's tensors) LogSketch.

    Returns (m,) float32 centers sorted ascending on the sketch's device, m = min(k, buckets).
    """
    _check_args(k, sigma, max_iter, tol)
    if not isinstance(sketch, LogSketch):
        raise ConfigError(f"approx_kmeans_from_sketch needs a LogSketch, got {type(sketch).__name__}")
    centers, counts = sketch.histogram()
    centers, counts = centers.cpu(), counts.cpu()
    if centers.numel() <= k:  # fewer distinct buckets than k: every bucket is its own level
        return centers.to(torch.float32).to(sketch.device)
    w = bucket_weights(centers, counts, sigma)
    out = weighted_kmeans_1d(centers, w, k, seed=seed, max_iter=max_iter, tol=tol, n_init=n_init,
                             n_local_trials=n_local_trials)
    return out.to(torch.float32).to(sketch.device)


def bucket_weights(centers: torch.Tensor, counts: torch.Tensor, sigma: float) -> torch.Tensor:
    """Algorithm 1 lines 2-3: sigma * counts/sum(counts) + (1 - sigma) * |centers|/sum(|centers|)."""
    if not 0.0 <= sigma <= 1.0:
        raise ConfigError(f"sigma must be in [0, 1], got {sigma}; the paper uses 0.2")
    freq = counts.to(torch.float64)
    freq = freq / freq.sum().clamp_min(1e-300)
    mag = centers.to(torch.float64).abs()
    mag_sum = mag.sum()
    mag = mag / mag_sum if float(mag_sum) > 0 else torch.zeros_like(mag)  # all-zero data: frequency only
    w = sigma * freq + (1.0 - sigma) * mag
    return w if float(w.sum()) > 0 else freq


def weighted_kmeans_1d(points: torch.Tensor, weights: torch.Tensor, k: int, *, seed: int = 0,
                       max_iter: int = 100, tol: float = 1e-7, n_init: int = 3,
                       n_local_trials: int | None = None) -> torch.Tensor:
    """Weighted 1-D k-means: k-means++ seeding (Algorithm 3) then Lloyd to convergence.

    points, weights: (B,) with weights >= 0. Returns (m,) float64 centers sorted ascending (CPU),
    m = min(k, distinct points). Stops when no center moves by more than tol * (max - min).
    n_local_trials: candidates per k-means++ step; 1 is the paper's Algorithm 3 verbatim, None
    (default) is 2 + ln(k) like scikit-learn, which avoids most poor local optima for the cost of a
    (trials, B) distance matrix per step. n_init: independent seedings (one generator), best kept.
    """
    _check_args(k, 0.0, max_iter, tol)
    if isinstance(n_init, bool) or not isinstance(n_init, int) or n_init < 1:
        raise ConfigError(f"n_init must be an int >= 1, got {n_init!r}")
    x = torch.as_tensor(points).detach().reshape(-1).to("cpu", torch.float64)
    w = torch.as_tensor(weights).detach().reshape(-1).to("cpu", torch.float64)
    if x.shape != w.shape:
        raise ConfigError(f"points and weights must have the same length, got {x.numel()} and {w.numel()}")
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(w).all())):
        raise NonFiniteError("weighted_kmeans_1d got inf/NaN points or weights")
    if bool((w < 0).any()):
        raise ConfigError("weighted_kmeans_1d weights must be >= 0")
    # merge duplicate points (sum their weights) so "distinct points" is well defined
    x, inv = torch.unique(x, sorted=True, return_inverse=True)
    w = torch.zeros_like(x).index_add_(0, inv, w)
    if x.numel() <= k:
        return x
    g = torch.Generator().manual_seed(int(seed))
    trials = n_local_trials if n_local_trials is not None else 2 + int(math.log(k))
    best, best_cost = None, math.inf
    for _ in range(n_init):  # B is small, so restarts are cheap; keep the lowest weighted SSE
        c = _lloyd(x, w, _kmeanspp(x, w, k, g, max(1, int(trials))), max_iter, tol * float(x[-1] - x[0]))
        cost = float((w * (x - c[_nearest(x, c)]).square()).sum())
        if cost < best_cost:
            best, best_cost = c, cost
    return best


def _kmeanspp(x: torch.Tensor, w: torch.Tensor, k: int, g: torch.Generator, n_trials: int) -> torch.Tensor:
    """Algorithm 3: first center ~ w, then each next ~ w * D^2 (D = distance to nearest center).

    With n_trials > 1 ("greedy k-means++", as in scikit-learn) each step draws n_trials candidates
    from the same distribution and keeps the one that lowers the weighted potential most.
    """
    chosen = torch.empty(k, dtype=torch.int64)
    p0 = w if float(w.sum()) > 0 else torch.ones_like(w)
    chosen[0] = torch.multinomial(p0, 1, generator=g)
    d2 = (x - x[chosen[0]]).square()
    for i in range(1, k):
        p = d2 * w
        if not float(p.sum()) > 0:
            # the remaining mass is on zero-weight points: take the farthest distinct point so the
            # result still has k distinct levels (x has > k distinct points here, so d2.max() > 0)
            nxt = torch.argmax(d2)
            d2 = torch.minimum(d2, (x - x[nxt]).square())
        else:
            cand = torch.multinomial(p, n_trials, replacement=True, generator=g)   # (T,)
            d2c = torch.minimum(d2, (x[None, :] - x[cand][:, None]).square())    # (T, B)
            best = int(torch.argmin((d2c * w).sum(1)))
            nxt, d2 = cand[best], d2c[best]
        chosen[i] = nxt
    return torch.sort(x[chosen]).values


def _lloyd(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, max_iter: int, tol_abs: float) -> torch.Tensor:
    """Weighted Lloyd on sorted 1-D points: clusters are contiguous, so use prefix sums."""
    cw = torch.cat([x.new_zeros(1), torch.cumsum(w, 0)])        # (B+1,) prefix weights
    cwx = torch.cat([x.new_zeros(1), torch.cumsum(w * x, 0)])   # (B+1,) prefix weighted sums
    for _ in range(max_iter):
        mids = (c[1:] + c[:-1]) * 0.5
        # cluster j = points in (mids[j-1], mids[j]]: a point on a midpoint goes to the lower center,
        # the same tie rule as assign()
        b = torch.cat([x.new_zeros(1, dtype=torch.int64), torch.searchsorted(x, mids, right=True),
                       torch.tensor([x.numel()])])
        sw = cw[b[1:]] - cw[b[:-1]]
        swx = cwx[b[1:]] - cwx[b[:-1]]
        # an empty (zero-weight) cluster keeps its center rather than jumping to 0
        new = torch.where(sw > 0, swx / sw.clamp_min(1e-300), c)
        new = torch.sort(new).values
        shift = float((new - c).abs().max())
        c = new
        if shift <= tol_abs:
            break
    return c


def _nearest(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted((c[1:] + c[:-1]) * 0.5, x)


def assign(values: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Index of the nearest center for every value (int64, values' shape and device).

    centers must be sorted ascending (as approx_kmeans returns them). Exact nearest-center via
    searchsorted on the midpoints; a value exactly on a midpoint goes to the lower center.
    """
    v = torch.as_tensor(values).detach()
    c = torch.as_tensor(centers).detach().reshape(-1).to(v.device)
    if c.numel() == 0:
        raise ConfigError("assign needs at least one center")
    if c.numel() > 1 and bool((c[1:] < c[:-1]).any()):
        raise ConfigError("assign needs centers sorted ascending; pass torch.sort(centers).values")
    dt = torch.float64 if v.dtype == torch.float64 or c.dtype == torch.float64 else torch.float32
    cf = c.to(dt)
    mids = (cf[1:] + cf[:-1]) * 0.5
    vf = v.reshape(-1).to(dt)
    if not bool(torch.isfinite(vf).all()):
        raise NonFiniteError(f"assign got {int((~torch.isfinite(vf)).sum())} non-finite value(s)")
    return torch.searchsorted(mids, vf).reshape(v.shape)


def _check_args(k: int, sigma: float, max_iter: int, tol: float) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k (number of levels) must be an int >= 1, got {k!r}")
    if not 0.0 <= float(sigma) <= 1.0:
        raise ConfigError(f"sigma must be in [0, 1], got {sigma}; the paper uses 0.2")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ConfigError(f"max_iter must be an int >= 1, got {max_iter!r}")
    if not (tol >= 0 and math.isfinite(tol)):
        raise ConfigError(f"tol must be a finite float >= 0, got {tol}")
