"""QD-Compressor's entropy-based variable bit-width uniform quantizer (the paper's "Uniform" baseline).

Inshrinkerator §8.2 describes the QD+ baseline as "an entropy-based variable bit-width uniform
quantization scheme and delta compression with Huffman encoding, used in QD-compressor", with a
search space of (min bins, max bins), each from {8, 16, 32, 64, 128, 256} (Table 10). QD-Compressor
(Jin et al., TPDS 2023) adapts "the number of quantization bits among layers based on the value
distribution and weighted entropy"; its exact formula is not in our papers, so this module makes
the rule concrete (more bins for higher-entropy tensors):

    1. quantize the tensor on the finest allowed grid: min-max uniform with ``max_bins`` levels;
    2. H = Shannon entropy (bits) of the histogram of those codes;
    3. bits = ceil(H), B = clamp(2 ** bits, min_bins, max_bins).

2 ** H is the tensor's perplexity on the finest grid (how many of its levels the values really
occupy), so B is the smallest power of two that covers it: a tensor whose values crowd into few
levels (heavy tails, Adam's v) gets few bins, a spread-out one gets many. H <= log2(max_bins), so
B <= max_bins without the clamp; min_bins is the floor the search asks for.

Quantization (min-max, levels on both endpoints, the same arithmetic as adaptive.py)::

    lo, hi = min(x), max(x);  scale = (hi - lo) / (B - 1)   (1 when hi == lo)
    code   = clamp(round((x - lo) / scale), 0, B - 1)       so |x - x'| <= scale / 2
    x'     = code * scale + lo  = codebook[code]

Codes are plain level indices 0..B-1, so QD's cyclic delta D = (C_prev - C_cur) mod B applies.
Because B varies per tensor and per checkpoint, the original QD description breaks when a tensor's
bin count changes between checkpoints (Inshrinkerator A.2: "an oversight ... where the number of
bins assigned to a layer changes between successive checkpoints"); the fix is that the delta
codec takes B = max(n_levels_prev, n_levels_cur), under which both code sets are valid residues.
This module only reports ``n_levels``; codec/delta.py applies the rule.

Call order::

    q = quantize(x, UniformConfig(min_bins=16, max_bins=256))
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

DESCRIPTOR = "uniform-entropy/1"
_MAX_LEVELS = 1 << 16  # codes stay cheap to histogram and delta-code

# Paper Table 10 (QD+). Pairs with min_bins > max_bins are invalid configs and raise ConfigError.
SEARCH_SPACE: dict[str, tuple] = {
    "min_bins": (8, 16, 32, 64, 128, 256),
    "max_bins": (8, 16, 32, 64, 128, 256),
}


@dataclass(frozen=True)
class UniformConfig:
    min_bins: int = 8    # floor on the per-tensor level count (Table 10)
    max_bins: int = 256  # ceiling; also the grid the entropy is measured on (Table 10)
    min_numel: int = MIN_NUMEL  # methods keep smaller tensors exact

    def __post_init__(self):
        bins = Range(ge=2, le=_MAX_LEVELS)
        check_fields(self, min_bins=bins, max_bins=bins, min_numel=MIN_NUMEL_RANGE)
        if self.min_bins > self.max_bins:
            raise ConfigError(f"UniformConfig.min_bins ({self.min_bins}) must be <= max_bins ({self.max_bins}); "
                              "skip this pair in the search")


# --------------------------------------------------------------------------- quantize / dequantize
def quantize(x: torch.Tensor, config: UniformConfig = UniformConfig()) -> QuantizedTensor:
    """Entropy-chosen bin count, then min-max uniform quantization (fp32 math on x's device)."""
    if not isinstance(config, UniformConfig):
        raise ConfigError(f"config must be a UniformConfig, got {type(config).__name__}")
    xf = flat_float32(x, "uniform")  # (n,)
    if xf.numel() == 0:
        lo = hi = torch.zeros((), dtype=torch.float32, device=xf.device)
    else:
        lo, hi = xf.min(), xf.max()
    fine, fine_scale = uniform_codes(xf, lo, hi, config.max_bins)
    h_bits = code_entropy_bits(fine, config.max_bins)
    n_levels = bins_for_entropy(h_bits, config.min_bins, config.max_bins)
    if n_levels == config.max_bins:
        codes, scale = fine, fine_scale  # the entropy grid is the answer: skip a pass
    else:
        codes, scale = uniform_codes(xf, lo, hi, n_levels)
    return QuantizedTensor(
        codes=codes,
        n_levels=n_levels,
        codebook=uniform_codebook(lo, scale, n_levels),
        shape=tuple(x.shape),
        dtype=dtype_name(x.dtype),
        meta={"descriptor": DESCRIPTOR, "entropy_bits": h_bits, "lo": float(lo), "hi": float(hi),
              "scale": float(scale), "min_bins": config.min_bins, "max_bins": config.max_bins},
    )


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """codebook[codes] reshaped to the original shape and cast to the original dtype."""
    return apply_codebook(q.codes, q.codebook).reshape(q.shape).to(torch_dtype(q.dtype))


# --------------------------------------------------------------------------- the entropy rule
def code_entropy_bits(codes: torch.Tensor, n_levels: int) -> float:
    """Shannon entropy in bits of the histogram of ``codes`` over ``n_levels`` levels (0 if empty)."""
    n = codes.numel()
    if n == 0:
        return 0.0
    counts = torch.bincount(codes, minlength=n_levels).to(torch.float64)
    p = counts[counts > 0] / n
    return float(-(p * torch.log2(p)).sum())


def bins_for_entropy(h_bits: float, min_bins: int, max_bins: int) -> int:
    """B = clamp(2 ** ceil(H), min_bins, max_bins): smallest power of two >= the perplexity 2^H."""
    bits = max(0, math.ceil(h_bits - 1e-9))  # 1e-9: H = 3.0000000001 from float sums is 3 bits
    return int(min(max(1 << min(bits, 30), min_bins), max_bins))


# --------------------------------------------------------------------------- shared min-max grid
def uniform_scale(lo: torch.Tensor, hi: torch.Tensor, n_levels: int) -> torch.Tensor:
    """(hi - lo) / (n_levels - 1) in fp32; 1 where hi == lo (every x is lo then, so code 0 is exact)."""
    scale = (hi - lo) / (n_levels - 1)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def uniform_codes(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_levels: int):
    """(codes int64, scale): clamp(round((x - lo) / scale), 0, n_levels - 1); lo/hi broadcast to x."""
    scale = uniform_scale(lo, hi, n_levels)
    codes = torch.round((x - lo) / scale).clamp_(0, n_levels - 1).to(torch.int64)
    return codes, scale


def uniform_values(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes * scale + lo in fp32: the single definition the codebook and the CNR search share."""
    return codes.to(torch.float32) * scale + lo


def uniform_codebook(lo: torch.Tensor, scale: torch.Tensor, n_levels: int) -> torch.Tensor:
    """(n_levels,) fp32 codebook[k] = k * scale + lo (same op order as uniform_values)."""
    k = torch.arange(n_levels, dtype=torch.int64, device=lo.device)
    return uniform_values(k, lo, scale)
