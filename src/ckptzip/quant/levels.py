"""The levels of a quantized group: value domains, centers from histograms, level boundaries.

Shared by DynaQuant's per-tensor reference (quant/dynaquant.py) and its batched path
(quant/dqbatch.py), so both fit and assign with the same arithmetic::

    centers_f = histogram_centers(ords, counts, row_ptr, k, cfg)[i]   # domain centers of row i
    bounds = level_bounds(centers_f, cfg.domain)                       # (k-1,) float32, x's domain
    level = 1 + searchsorted(bounds, x)                                # = 1 + #(bounds < x)
    codebook value = from_domain(centers_f)

A domain f is where k-means runs: "identity", "sqrt" (sign(x) sqrt|x|) or "log" (x > 0 only).
"""
from __future__ import annotations

import math

import torch

from ..kmeans import bucket_weights, kmeans_packed, weighted_kmeans_1d
from ..sketch import LogSketch

__all__ = ["DOMAINS", "to_domain", "from_domain", "histogram_centers", "level_bounds"]

DOMAINS = ("identity", "sqrt", "log")


def to_domain(x: torch.Tensor, domain: str) -> torch.Tensor:
    if domain == "identity":
        return x
    if domain == "sqrt":
        return x.sign() * x.abs().sqrt()
    return x.log()  # "log": callers pass x > 0 only (zeros take the exact-zero level)


def from_domain(y: torch.Tensor, domain: str) -> torch.Tensor:
    if domain == "identity":
        return y
    if domain == "sqrt":
        return y.sign() * y * y
    return y.exp()


def histogram_centers(ords: torch.Tensor, counts: torch.Tensor, row_ptr: torch.Tensor, k: int,
                      cfg) -> list[torch.Tensor]:
    """Centers (float32, the config's domain, sorted, CPU) of every histogram row
    ``ords/counts[row_ptr[i]:row_ptr[i+1]]`` (LogSketch ordinals): Algorithm 1 in the domain per
    row -- bucket representatives mapped by f, weighted by ``cfg.sigma`` -- all rows in one
    batched k-means for ``cfg.kmeans == "density"``. A row's result does not depend on the others.
    """
    pts = to_domain(LogSketch(cfg.alpha).ordinal_values(ords.cpu()), cfg.domain)
    counts = counts.cpu()
    sizes = row_ptr.diff()
    if cfg.domain == "log":  # the zero bucket (|x| <= 1e-30) maps to -inf; the boundaries send it down
        keep = torch.isfinite(pts)
        row = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
        sizes = torch.zeros_like(sizes).index_add_(0, row, keep.long())
        pts, counts = pts[keep], counts[keep]
    if cfg.kmeans == "density":
        out = kmeans_packed(pts, counts, sizes, k, sigma=cfg.sigma)
    else:  # Algorithm 3 (sampled seeding), one row at a time
        rows_p, rows_c = torch.split(pts, sizes.tolist()), torch.split(counts, sizes.tolist())
        out = [p if p.numel() <= k else weighted_kmeans_1d(p, bucket_weights(p, c, cfg.sigma), k, seed=cfg.seed)
               for p, c in zip(rows_p, rows_c)]
    if not out:
        return []
    sizes = [c.numel() for c in out]  # one conversion of them all, then views: ~1.5 us a row less
    return list(torch.cat(out).to(torch.float32).split(sizes))


def level_bounds(centers_f: torch.Tensor, domain: str) -> torch.Tensor:
    """(k-1,) float32 boundaries between sorted domain centers, in x's own domain: a quantized
    value x takes level 1 + #(bounds < x), the nearest center in the domain (a tie goes down).
    f^-1 of each midpoint in float64, rounded *down* to float32, so that for float32 x,
    x > bound32 exactly when x > the float64 boundary. (R, k) centers give (R, k-1) boundaries
    row by row (a row padded with +inf centers gets +inf boundaries there)."""
    c = centers_f.detach().to(torch.float64)
    c = c if c.dim() == 2 else c.reshape(-1)
    b = from_domain((c[..., 1:] + c[..., :-1]) * 0.5, domain)
    b32 = b.to(torch.float32)
    return torch.where(b32.double() > b, torch.nextafter(b32, torch.full_like(b32, -math.inf)), b32)
