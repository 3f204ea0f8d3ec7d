"""Check-N-Run's adaptive uniform quantizer (the paper's "Adaptive" baseline, CNR+).

Inshrinkerator §8.2 / A.2: CNR+ implements only Check-N-Run's quantization algorithm, the greedy
clipping-range search of Guan et al. 2019 ("Post-training 4-bit quantization on embedding
tables"), with the search space of Table 11: number of bins {8..256}, number of step bins
{10, 25, 50, 100}, range {0.1 .. 0.5}.

The greedy search (as in the reference implementation that ships with that paper's operators,
caffe2's ``param_search_greedy``, there with n_step_bins = 200 and ratio = 0.16)::

    lo, hi = min(x), max(x);  step = (hi - lo) / n_step_bins
    loss(a, b) = sum (x - x'_{a,b})^2   with x' the B-level min-max quantization clipped to [a, b]
    repeat ceil(range_ratio * n_step_bins) times   (i.e. until the range has shrunk by range_ratio):
        l1 = loss(lo + step, hi)        # move the min up one step
        l2 = loss(lo, hi - step)        # or the max down one step
        take the move with the lower loss (ties move the max), even if it is worse than now
    return the visited range with the lowest loss

Differences from the reference, on purpose:
  * we return the best *visited* range, the start [min, max] included; the reference keeps the best
    of its local optima and falls back to [min, max]. The two agree except when the best point is
    the last one visited (the reference never tests it); ours guarantees MSE <= plain min-max.
  * positions are kept as integer step counts (lo = min + i * step, hi = max - j * step), so the
    loop length is exact rather than subject to fp32 drift, and the chosen range is bit-identical
    to the one whose loss was measured.
  * no fp16 rounding of scale/bias (Guan et al. store them as fp16; a checkpoint keeps fp32).

Cost: a candidate's loss is read from prefix sums of the sorted row (per-level sums of x and x^2,
O(n_bins log C) per candidate after one O(C log C) sort, ~20 extra bytes per element) instead of
re-quantizing the row (O(C) per candidate; kept as the plain reference, ``evaluator="direct"``, and
used for short rows). Both give the same choices (tested); 4M values, 50 steps: ~2 s vs ~30 s on CPU.

Levels and codes are exactly those of uniform.py (levels on both ends of [lo, hi]); values outside
[lo, hi] are clipped to the end levels.

Per row (``row_wise=True``): the original quantizes each row of an embedding table with its own
range. For a tensor with >= 2 dims the rows are ``x.reshape(shape[0], -1)``; each row runs its own
greedy path, vectorized across rows (every step evaluates both candidate moves of every row in one
batched op). 1-D tensors are always one row. Per-row output has no single codebook (all NaN); the
per-row ``lo`` and ``scale`` are in ``side``.

Call order::

    q = quantize(x, AdaptiveConfig(bins=16, step_bins=50, range_ratio=0.3))
    y = dequantize(q)                      # x's shape and dtype
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..configcheck import Range, check_fields
from ..errors import ConfigError
from ..tensorbytes import dtype_name, torch_dtype
from .base import MIN_NUMEL, MIN_NUMEL_RANGE, QuantizedTensor, apply_codebook, flat_float32
from .uniform import uniform_codebook, uniform_codes, uniform_scale, uniform_values

DESCRIPTOR = "adaptive-greedy/1"
_MAX_LEVELS = 1 << 16
_CHUNK_ELEMS = 1 << 22  # elements per temporary in the loss evaluation (bounds memory on big tensors)

# Paper Table 11 (CNR+).
SEARCH_SPACE: dict[str, tuple] = {
    "bins": (8, 16, 32, 64, 128, 256),
    "step_bins": (10, 25, 50, 100),
    "range_ratio": (0.1, 0.2, 0.3, 0.4, 0.5),
}


@dataclass(frozen=True)
class AdaptiveConfig:
    bins: int = 16            # quantization levels, 2 ** bits (Table 11 "Number of bins")
    step_bins: int = 100      # search step = (max - min) / step_bins (Table 11 "Number of step bins")
    range_ratio: float = 0.2  # search stops once the range has shrunk by this fraction (Table 11 "Range")
    row_wise: bool = False    # own range per row of a >= 2-D tensor (Guan et al.'s embedding rows)
    min_numel: int = MIN_NUMEL  # methods keep smaller tensors exact

    def __post_init__(self):
        check_fields(self, bins=Range(ge=2, le=_MAX_LEVELS), step_bins=Range(ge=1), range_ratio=Range(ge=0, lt=1),
                     min_numel=MIN_NUMEL_RANGE)

    @property
    def n_steps(self) -> int:
        """Greedy moves: the range shrinks while (step_bins - t) > step_bins * (1 - range_ratio)."""
        return max(0, math.ceil(self.range_ratio * self.step_bins - 1e-9))  # 0.3 * 10 is 3, not 4


# --------------------------------------------------------------------------- quantize / dequantize
def quantize(x: torch.Tensor, config: AdaptiveConfig = AdaptiveConfig()) -> QuantizedTensor:
    """Greedy clipping-range search, then min-max uniform quantization on the chosen range."""
    if not isinstance(config, AdaptiveConfig):
        raise ConfigError(f"config must be an AdaptiveConfig, got {type(config).__name__}")
    xf = flat_float32(x, "adaptive")  # (n,)
    row_wise = config.row_wise and x.dim() >= 2 and xf.numel() > 0
    X = xf.view(x.shape[0], -1) if row_wise else xf.view(1, -1)  # (R, C)
    B = config.bins
    if X.numel() == 0:
        lo = hi = torch.zeros((1, 1), dtype=torch.float32, device=xf.device)
        steps = torch.zeros((2, 1, 1), dtype=torch.int64)
    else:
        lo, hi, steps = greedy_range(X, B, config.step_bins, config.n_steps)
    codes, scale = uniform_codes(X, lo, hi, B)  # (R, C), (R, 1)
    meta = {"descriptor": DESCRIPTOR, "row_wise": row_wise, "bins": B,
            "step_bins": config.step_bins, "range_ratio": float(config.range_ratio)}
    if row_wise:
        codebook = torch.full((B,), float("nan"), dtype=torch.float32, device=xf.device)
        side = {"lo": lo.reshape(-1), "scale": scale.reshape(-1)}
        meta["n_rows"] = X.shape[0]
    else:
        codebook = uniform_codebook(lo.reshape(()), scale.reshape(()), B)
        side = {}
        meta.update(lo=float(lo), hi=float(hi), scale=float(scale),
                    steps_min=int(steps[0].reshape(-1)[0]), steps_max=int(steps[1].reshape(-1)[0]))
    return QuantizedTensor(codes=codes.reshape(-1), n_levels=B, codebook=codebook, shape=tuple(x.shape),
                           dtype=dtype_name(x.dtype), side=side, meta=meta)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """codebook[codes], or codes * scale_row + lo_row for row-wise output; x's shape and dtype."""
    if "lo" in q.side:
        lo, scale = q.side["lo"].to(torch.float32), q.side["scale"].to(torch.float32)
        rows = lo.numel()
        y = uniform_values(q.codes.reshape(rows, -1), lo[:, None], scale[:, None])
    else:
        y = apply_codebook(q.codes, q.codebook)
    return y.reshape(q.shape).to(torch_dtype(q.dtype))


# --------------------------------------------------------------------------- the greedy search
def greedy_range(X: torch.Tensor, n_bins: int, n_step_bins: int, n_steps: int, *, evaluator: str = "auto"):
    """Per-row greedy range search on X (R, C) fp32.

    ``evaluator`` picks how a candidate range's loss is measured: "direct" quantizes the row
    (the plain reference, O(C) per candidate), "sorted" uses prefix sums over the sorted row
    (O(n_bins log C) per candidate after one sort; about 20 extra bytes per element), "auto"
    takes "sorted" when rows are long enough (C > 2 n_bins) for it to pay.
    Returns (lo (R, 1), hi (R, 1), steps (2, R, 1) int64: min-side and max-side moves taken).
    """
    if evaluator == "auto":
        evaluator = "sorted" if X.shape[1] > 2 * n_bins else "direct"
    if evaluator == "sorted":
        loss_fn = _SortedLoss(X, n_bins)
    elif evaluator == "direct":
        def loss_fn(lo, hi):
            return _sq_err(X, lo, hi, n_bins)
    else:
        raise ConfigError(f"evaluator must be 'auto', 'sorted' or 'direct', got {evaluator!r}")
    lo0 = X.amin(dim=1, keepdim=True)  # (R, 1)
    hi0 = X.amax(dim=1, keepdim=True)
    step = (hi0 - lo0) / n_step_bins  # (R, 1); 0 on a constant row: every candidate equals the start
    i = torch.zeros_like(lo0, dtype=torch.int64)  # moves of the min (up)
    j = torch.zeros_like(lo0, dtype=torch.int64)  # moves of the max (down)
    best_i, best_j = i, j
    best = loss_fn(lo0[None], hi0[None])[0]  # (R, 1) float64
    for _ in range(n_steps):
        ci = torch.stack([i + 1, i])  # (2, R, 1): candidate 0 moves the min, candidate 1 the max
        cj = torch.stack([j, j + 1])
        loss = loss_fn(_lo(lo0, ci, step), _hi(hi0, cj, step))  # (2, R, 1)
        move_min = loss[0] < loss[1]  # ties move the max, as the reference does
        i = torch.where(move_min, i + 1, i)
        j = torch.where(move_min, j, j + 1)
        cur = torch.where(move_min, loss[0], loss[1])
        better = cur < best  # strict: on a tie keep the earlier, wider range
        best = torch.where(better, cur, best)
        best_i = torch.where(better, i, best_i)
        best_j = torch.where(better, j, best_j)
    return _lo(lo0, best_i, step), _hi(hi0, best_j, step), torch.stack([best_i, best_j])


def _lo(lo0: torch.Tensor, k: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    # one formula for candidates and the final range, so the chosen range is the one measured
    return lo0 + k.to(torch.float32) * step


def _hi(hi0: torch.Tensor, k: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return hi0 - k.to(torch.float32) * step


def _sq_err(X: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Reference: sum_c (X - x')^2 per candidate range; X (R, C), lo/hi (K, R, 1) -> (K, R, 1) float64."""
    K, R = lo.shape[0], X.shape[0]
    C = X.shape[1]
    chunk = max(1, _CHUNK_ELEMS // (K * R))
    out = torch.zeros((K, R, 1), dtype=torch.float64, device=X.device)
    for c0 in range(0, C, chunk):
        xs = X[None, :, c0:c0 + chunk]  # (1, R, c)
        codes, scale = uniform_codes(xs, lo, hi, n_bins)
        d = (xs - uniform_values(codes, lo, scale)).to(torch.float64)  # (K, R, c); squared in fp64
        out += torch.sum(d * d, dim=2, keepdim=True)
    return out


class _SortedLoss:
    """Same loss as _sq_err from per-level sums: the values that round to level k are a contiguous
    run of the sorted row, so sum (x - c_k)^2 = S2 - 2 c_k S1 + n c_k^2 over that run, read off
    prefix sums. Rows are centred on their midpoint first so the float64 sums don't cancel.
    Only a value exactly on a rounding boundary may land on the other level, where its error is
    the same."""

    def __init__(self, X: torch.Tensor, n_bins: int):
        self.n_bins = n_bins
        self.xs = torch.sort(X, dim=1).values  # (R, C)
        R, C = self.xs.shape
        self.mid = ((self.xs[:, :1] + self.xs[:, -1:]) / 2).to(torch.float64)  # (R, 1)
        xc = self.xs.to(torch.float64) - self.mid
        self.p1 = torch.zeros((R, C + 1), dtype=torch.float64, device=X.device)
        self.p2 = torch.zeros_like(self.p1)
        torch.cumsum(xc, 1, out=self.p1[:, 1:])
        torch.cumsum(xc * xc, 1, out=self.p2[:, 1:])
        self.levels = torch.arange(n_bins, dtype=torch.int64, device=X.device)

    def __call__(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        K, R, _ = lo.shape
        C = self.xs.shape[1]
        B = self.n_bins
        scale = uniform_scale(lo, hi, B)  # (K, R, 1)
        # x rounds above level k once x >= lo + (k + 1/2) scale; x < lo clips to 0, x > hi to B-1
        thr = lo + (self.levels[:-1].to(torch.float32) + 0.5) * scale  # (K, R, B-1)
        idx = torch.searchsorted(self.xs, thr.permute(1, 0, 2).reshape(R, K * (B - 1)))  # #x < thr
        idx = idx.reshape(R, K, B - 1).permute(1, 0, 2)
        b = torch.cat([idx.new_zeros((K, R, 1)), idx, idx.new_full((K, R, 1), C)], dim=2)  # (K, R, B+1)
        p1 = self.p1.expand(K, R, C + 1)
        p2 = self.p2.expand(K, R, C + 1)
        s1 = p1.gather(2, b[..., 1:]) - p1.gather(2, b[..., :-1])  # (K, R, B)
        s2 = p2.gather(2, b[..., 1:]) - p2.gather(2, b[..., :-1])
        cnt = (b[..., 1:] - b[..., :-1]).to(torch.float64)
        c = uniform_values(self.levels, lo, scale).to(torch.float64) - self.mid  # (K, R, B): the fp32 levels
        return (s2 - 2 * c * s1 + cnt * c * c).sum(dim=2, keepdim=True)
