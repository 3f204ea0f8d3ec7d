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

**Many histograms at once** (``kmeans_rows``, the quantizer's default ``kmeans="density"``): a
named, measured variant for speed. Seeding is deterministic instead of sampled: the high-resolution
optimum of 1-D quantization places centers with density proportional to p^(1/3) (Panter & Dite),
so centers start at quantiles of (w_i / s_i)^e * s_i (s_i: spacing of the sorted points around
point i, w_i: its weight) for e = 1/3 and 1/2 (more to the sparse tails), each at three quantile
grids ((i + .5)/k, i/(k - 1), (i + .25)/(k - .5)); all rows and their six seedings run one
batched Lloyd (padded rows, converged rows frozen, so a row's result does not depend on its
batch) and each row keeps its seeding of lowest weighted SSE: plain torch, and beside it two
numba kernels around torch's pow doing the same (identical bits). On the tensors DynaQuant
quantizes (>= 1024 values: every 2-D tensor and Adam moment of a trained byte-level GPT, and of
the digits MLP) its SSE is 0.97-1.00x that of
``weighted_kmeans_1d`` on average, at most 1.06x, for k = 4..32 and sigma 0.2 / 1
(tests/test_kmeans.py); it costs a few dozen torch ops per *batch* instead of thousands per tensor.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ckptzip.errors import ConfigError, NonFiniteError
from ckptzip.inplace import segment_offsets
from ckptzip.sketch import LogSketch

try:  # optional fast path for the batched Lloyd; _lloyd_rows is its plain-torch reference
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["approx_kmeans", "approx_kmeans_from_sketch", "assign", "weighted_kmeans_1d", "bucket_weights",
           "kmeans_rows", "kmeans_packed", "INITS"]

INITS = ("density", "kmeans++")  # kmeans_rows' deterministic seeding; weighted_kmeans_1d's sampled one


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


def kmeans_rows(points, counts, k: int, *, sigma: float = 1.0, max_iter: int = 100, tol: float = 1e-7,
                backend: str = "auto") -> list[torch.Tensor]:
    """Algorithm 1 on many histograms at once, deterministic (module docstring, "density").

    points[r], counts[r]: (B_r,) sorted strictly ascending bucket representatives (in the
    k-means domain) and their counts; each row is weighted as ``bucket_weights(points, counts,
    sigma)``. Returns per row the (m,) float64 centers on CPU sorted ascending, m = min(k, B_r);
    a row with B_r <= k gets its points. A row's result is the same whatever else is in the batch
    (sums run in order over padded rows). ``backend``: "auto" (the numba kernels when installed),
    "numba" or "torch" (the reference; both give identical bits).
    """
    xs = [torch.as_tensor(x).reshape(-1).to("cpu", torch.float64) for x in points]
    cs = [torch.as_tensor(c).reshape(-1).to("cpu", torch.float64) for c in counts]
    sizes = torch.tensor([x.numel() for x in xs], dtype=torch.int64)
    packed = (torch.cat(xs), torch.cat(cs)) if xs else (torch.zeros(0), torch.zeros(0))
    return kmeans_packed(*packed, sizes, k, sigma=sigma, max_iter=max_iter, tol=tol, backend=backend)


def kmeans_packed(points: torch.Tensor, counts: torch.Tensor, sizes: torch.Tensor, k: int, *, sigma: float = 1.0,
                  max_iter: int = 100, tol: float = 1e-7, backend: str = "auto") -> list[torch.Tensor]:
    """``kmeans_rows`` of the rows packed one after the other: row r is ``points[a:a + sizes[r]]``
    (and its counts) where a is the sum of the sizes before it. The same results, without a
    caller's rows split apart and joined again (a save's histograms come packed)."""
    _check_args(k, sigma, max_iter, tol)
    if backend not in ("auto", "numba", "torch"):
        raise ConfigError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
    points = points.reshape(-1).to("cpu", torch.float64)
    counts = counts.reshape(-1).to("cpu", torch.float64)
    sizes = sizes.reshape(-1).to("cpu", torch.int64)
    sz = sizes.numpy()  # the bookkeeping in numpy: a save's two calls made ~15 small torch calls each
    at = segment_offsets(sz.tolist()).tolist()
    todo_mask = sz > k
    out: list[torch.Tensor | None] = [None if big else points[a:e]
                                      for big, a, e in zip(todo_mask.tolist(), at, at[1:])]
    todo = [r for r, o in enumerate(out) if o is None]
    if not todo:
        return out
    n = torch.from_numpy(sz[todo_mask])
    if len(todo) < sz.size:  # the rows k-means runs on, still packed
        keep = torch.from_numpy(np.repeat(todo_mask, sz))
        points, counts = points[keep], counts[keep]
    # pad with the batch's largest point at zero count: every sum, and every searchsorted of a
    # row's midpoints (all below its own last point), is what the row alone gives
    pad = float(points.numpy()[np.cumsum(n.numpy()) - 1].max())
    if backend == "torch" or _numba is None:
        rows, cnts = torch.split(points, n.tolist()), torch.split(counts, n.tolist())
        x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)      # (R, B)
        cnt = torch.nn.utils.rnn.pad_sequence(cnts, batch_first=True)                  # (R, B)
        w = _weights_rows(x, cnt, n, sigma)
        c, cost = _lloyd_rows(x, w, n, _density_seeds(x, w, n, k), max_iter, tol)      # (R, S, k), (R, S)
        best = cost.argmin(1)                                                          # first seeding wins ties
        pick = c[torch.arange(len(todo)), best]
    else:
        pick = _kmeans_rows_numba(points, counts, n, pad, k, sigma, max_iter, tol)
    for i, r in enumerate(todo):
        out[r] = pick[i]
    return out


def _weights_rows(x: torch.Tensor, cnt: torch.Tensor, n: torch.Tensor, sigma: float) -> torch.Tensor:
    """``bucket_weights`` of every padded row; row sums are in-order cumsums (padding adds 0.0)."""
    def rowsum(t):
        return torch.cumsum(t, 1)[:, -1:]

    valid = torch.arange(x.shape[1])[None, :] < n[:, None]
    freq = cnt / rowsum(cnt).clamp_min(1e-300)
    mag = torch.where(valid, x.abs(), 0.0)
    ms = rowsum(mag)
    mag = torch.where(ms > 0, mag / torch.where(ms > 0, ms, 1.0), 0.0)
    w = sigma * freq + (1.0 - sigma) * mag
    return torch.where(rowsum(w) > 0, w, freq)


DENSITY_EXPONENTS = (1.0 / 3.0, 0.5)  # p^(1/3): the high-resolution optimum; p^(1/2): more to the tails


def _density_seeds(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor, k: int) -> torch.Tensor:
    """(R, S, k) initial centers: k distinct points at three quantile grids of the p^e mass, for
    each e in DENSITY_EXPONENTS (S = 3 * len(DENSITY_EXPONENTS))."""
    R, B = x.shape
    j = torch.arange(B)[None, :]
    last = (n - 1)[:, None]
    s = torch.empty_like(x)                                            # spacing around each point
    s[:, 1:-1] = (x[:, 2:] - x[:, :-2]) * 0.5
    s[:, 0], s[:, -1] = x[:, 1] - x[:, 0], 0.0
    s = torch.where(j == last, x.gather(1, last) - x.gather(1, last - 1), s)
    dens = w / s.clamp_min(1e-300)
    grids = _seed_grids(k)                                             # (3k,)
    idx = []
    for e in DENSITY_EXPONENTS:
        cm = torch.cumsum(torch.where(j > last, 0.0, dens.pow(e) * s), 1)
        idx.append(torch.searchsorted(cm, grids[None, :] * cm[:, -1:]).reshape(R, 3, k))
    idx = torch.cat(idx, 1)
    ii = torch.arange(k)
    idx = torch.cummax(idx - ii, 2).values + ii                        # strictly increasing ...
    idx = torch.minimum(idx, n[:, None, None] - k + ii)                # ... and inside each row
    S = idx.shape[1]
    return x.gather(1, idx.reshape(R, S * k)).reshape(R, S, k)


@functools.lru_cache(maxsize=16)
def _seed_grids(k: int) -> torch.Tensor:
    """The three quantile grids a density seeding places k centers at, concatenated (3k,); built once
    per k (every save's k-means asks again), so read-only."""
    i = torch.arange(k, dtype=torch.float64)
    return torch.cat([(i + 0.5) / k, i / max(k - 1, 1), (i + 0.25) / (k - 0.5)])


def _lloyd_rows(x: torch.Tensor, w: torch.Tensor, n: torch.Tensor, c: torch.Tensor, max_iter: int,
                tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched weighted Lloyd on sorted rows, S seedings each (prefix sums, as ``_lloyd``); every
    (row, seeding) stops on its own. c: (R, S, k). Returns the centers and their weighted SSE."""
    R, S, k = c.shape
    z = x.new_zeros(R, 1)
    cw = torch.cat([z, torch.cumsum(w, 1)], 1)                         # (R, B+1) prefix sums
    cwx = torch.cat([z, torch.cumsum(w * x, 1)], 1)
    tol_abs = (tol * (x.gather(1, (n - 1)[:, None]) - x[:, :1]))[:, :, None]  # (R, 1, 1)
    ends = torch.stack([torch.zeros_like(n), n], 1)[:, None, :].expand(R, S, 2)
    live = torch.ones(R, S, 1, dtype=torch.bool)

    def sums(c, *prefix):
        mids = (c[..., 1:] + c[..., :-1]) * 0.5                         # same tie rule as assign()
        b = torch.searchsorted(x, mids.reshape(R, -1), right=True).clamp_max(n[:, None]).reshape(R, S, k - 1)
        b = torch.cat([ends[..., :1], b, ends[..., 1:]], 2).reshape(R, -1)
        return [(p.gather(1, b).reshape(R, S, k + 1).diff(dim=2)) for p in prefix]

    for _ in range(max_iter):
        sw, swx = sums(c, cw, cwx)
        new = torch.where(sw > 0, swx / sw.clamp_min(1e-300), c)      # an empty cluster keeps its center
        new = torch.sort(new, 2).values
        moved = (new - c).abs().amax(2, keepdim=True) > tol_abs
        c = torch.where(live, new, c)
        live &= moved
        if not bool(live.any()):
            break
    cwxx = torch.cat([z, torch.cumsum(w * x * x, 1)], 1)
    sw, swx, swxx = sums(c, cw, cwx, cwxx)
    return c, torch.cumsum(swxx - 2.0 * c * swx + c * c * sw, 2)[..., -1]  # summed in order, as the kernel


def _kmeans_rows_numba(points, counts, n, pad: float, k: int, sigma: float, max_iter: int, tol: float
                       ) -> torch.Tensor:
    """kmeans_rows' (R, k) centers by two numba calls around the seeding's powers, which stay
    torch's (its pow's last bits are its own): ``_weights_rows``, ``_density_seeds``, ``_lloyd_rows``
    and the best seeding, with the same operations in the same order (identical bits), where the
    torch reference runs ~40 small ops a batch (issue 15)."""
    R, B = n.numel(), int(n.max())
    ptr = torch.cat([n.new_zeros(1), n.cumsum(0)])
    x, w, s, dens = (torch.empty(R, B, dtype=torch.float64) for _ in range(4))
    _density_inputs(points.contiguous().numpy(), counts.contiguous().numpy(), ptr.numpy(), pad, float(sigma),
                    1.0 - sigma, x.numpy(), w.numpy(), s.numpy(), dens.numpy())
    powers = torch.stack([dens.pow(e) for e in DENSITY_EXPONENTS])
    centers = torch.empty(R, k, dtype=torch.float64)
    _density_lloyd(x.numpy(), w.numpy(), n.numpy(), s.numpy(), powers.numpy(), _seed_grids(k).numpy(),
                   int(max_iter), float(tol), centers.numpy())
    return centers


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


if _numba is not None:
    @_numba.njit(cache=True, nogil=True, error_model="numpy")  # vectorized divisions (momentkernels)
    def _lloyd_kernel(x, n, cw, cwx, cwxx, tol_abs, max_iter, c, cost):  # pragma: no cover - compiled
        R, S, k = c.shape
        b = np.empty(k + 1, dtype=np.int64)
        new = np.empty(k, dtype=np.float64)
        for r in range(R):
            nr = n[r]
            for s in range(S):
                cc = c[r, s]
                it = 0
                done = False
                while True:
                    b[0] = 0
                    b[k] = nr
                    for j in range(k - 1):          # searchsorted(right=True) of each midpoint
                        mid = (cc[j + 1] + cc[j]) * 0.5
                        lo, hi = 0, nr
                        while lo < hi:
                            h = (lo + hi) >> 1
                            if x[r, h] <= mid:
                                lo = h + 1
                            else:
                                hi = h
                        b[j + 1] = lo
                    if done or it == max_iter:
                        break
                    for j in range(k):
                        sw = cw[r, b[j + 1]] - cw[r, b[j]]
                        swx = cwx[r, b[j + 1]] - cwx[r, b[j]]
                        new[j] = swx / max(sw, 1e-300) if sw > 0 else cc[j]
                    for j in range(1, k):           # insertion sort (k is small)
                        v = new[j]
                        i = j - 1
                        while i >= 0 and new[i] > v:
                            new[i + 1] = new[i]
                            i -= 1
                        new[i + 1] = v
                    shift = 0.0
                    for j in range(k):
                        shift = max(shift, abs(new[j] - cc[j]))
                        cc[j] = new[j]
                    it += 1
                    done = not shift > tol_abs[r]
                acc = 0.0
                for j in range(k):
                    sw = cw[r, b[j + 1]] - cw[r, b[j]]
                    swx = cwx[r, b[j + 1]] - cwx[r, b[j]]
                    swxx = cwxx[r, b[j + 1]] - cwxx[r, b[j]]
                    acc += swxx - 2.0 * cc[j] * swx + cc[j] * cc[j] * sw
                cost[r, s] = acc

    @_numba.njit(cache=True, nogil=True, error_model="numpy")  # vectorized divisions (momentkernels)
    def _density_inputs(xf, cf, ptr, pad, sigma, rest, x, w, s, dens):  # pragma: no cover - compiled
        """Padded (R, B) points, ``_weights_rows``' weights, ``_density_seeds``' spacings and densities
        of the rows xf/cf[ptr[r]:ptr[r + 1]] (each of n >= 2 points), summed in order as torch's cumsum."""
        R, B = x.shape
        for r in range(R):
            a, nr = ptr[r], ptr[r + 1] - ptr[r]
            for j in range(B):
                x[r, j] = xf[a + j] if j < nr else pad
            tc = tm = 0.0
            for j in range(B):
                tc += cf[a + j] if j < nr else 0.0
                tm += abs(x[r, j]) if j < nr else 0.0
            tc = max(tc, 1e-300)
            tw = 0.0
            for j in range(B):
                freq = (cf[a + j] if j < nr else 0.0) / tc
                mag = (abs(x[r, j]) if j < nr else 0.0) / tm if tm > 0 else 0.0
                w[r, j] = sigma * freq + rest * mag
                tw += w[r, j]
            if not tw > 0:
                for j in range(B):
                    w[r, j] = (cf[a + j] if j < nr else 0.0) / tc
            for j in range(1, B - 1):
                s[r, j] = (x[r, j + 1] - x[r, j - 1]) * 0.5
            s[r, 0], s[r, B - 1] = x[r, 1] - x[r, 0], 0.0
            s[r, nr - 1] = x[r, nr - 1] - x[r, nr - 2]
            for j in range(B):
                dens[r, j] = w[r, j] / max(s[r, j], 1e-300)

    @_numba.njit(cache=True, nogil=True, error_model="numpy")  # vectorized divisions (momentkernels)
    def _density_lloyd(x, w, n, s, powers, grids, max_iter, tol, out):  # pragma: no cover - compiled
        """``_density_seeds`` from the densities' powers (E, R, B), then ``_lloyd_kernel`` on every
        seeding, and each row's seeding of least cost (the first on ties) into ``out`` (R, k)."""
        R, B = x.shape
        E, G, k = powers.shape[0], grids.shape[0], out.shape[1]
        S = E * (G // k)
        c = np.empty((R, S, k), dtype=np.float64)
        cm = np.empty(B, dtype=np.float64)
        idx = np.empty(G, dtype=np.int64)
        for r in range(R):
            last = n[r] - 1
            for e in range(E):
                acc = 0.0
                for j in range(B):
                    acc += 0.0 if j > last else powers[e, r, j] * s[r, j]
                    cm[j] = acc
                for g in range(G):  # as torch.searchsorted (left): the first j with cm[j] >= v
                    idx[g] = np.searchsorted(cm, grids[g] * cm[B - 1])
                for q in range(G // k):  # strictly increasing, inside the row
                    top = idx[q * k]
                    for i in range(k):
                        top = max(top, idx[q * k + i] - i)
                        c[r, e * (G // k) + q, i] = x[r, min(top + i, n[r] - k + i)]
        z = np.zeros((R, B + 1), dtype=np.float64)
        cw, cwx, cwxx = z, z.copy(), z.copy()
        tol_abs = np.empty(R, dtype=np.float64)
        for r in range(R):
            for j in range(B):
                wx = w[r, j] * x[r, j]
                cw[r, j + 1] = cw[r, j] + w[r, j]
                cwx[r, j + 1] = cwx[r, j] + wx
                cwxx[r, j + 1] = cwxx[r, j] + wx * x[r, j]
            tol_abs[r] = tol * (x[r, n[r] - 1] - x[r, 0])
        cost = np.empty((R, S), dtype=np.float64)
        _lloyd_kernel(x, n, cw, cwx, cwxx, tol_abs, max_iter, c, cost)
        for r in range(R):
            best = 0
            for q in range(1, S):
                if cost[r, q] < cost[r, best]:
                    best = q
            out[r] = c[r, best]
else:  # pragma: no cover
    _lloyd_kernel = _density_inputs = _density_lloyd = None
