"""BitSnap cluster-based 8-bit quantization for optimizer states (BitSnap §3.4, Algo. 2).

Adam moments and fp32 master weights are roughly normal but far from uniform, so one min-max
8-bit grid wastes most of its levels on the tails. BitSnap splits the value range into at most 16
clusters, denser near the centre of the distribution, and quantizes each cluster on its own
asymmetric uint8 grid.

Cluster placement (the paper's "number of clusters follows the normal distribution", made
concrete): fit N(mu, sigma) with the tensor's mean and (population) std, and cut the real line at
that normal's quantiles

    b_i = mu + sigma * Phi^-1(i / K),   i = 1 .. K-1

so each cluster would hold n/K elements if the tensor were exactly normal, and clusters are
narrow near mu and wide in the tails. Element x gets label l with b_{l-1} < x <= b_l
(b_0 = -inf, b_K = +inf). A cluster that no element falls in (e.g. the negative ones for Adam's
v >= 0, whose fitted normal extends below zero) is simply empty: scale 0, min 0.

Per cluster l (Dettmers et al. asymmetric form, paper Eq. 3-4):

    scale_l = (max_l - min_l) / 255,   q = round((x - min_l) / scale_l) in [0, 255]
    x'      = min_l + q * scale_l      so |x - x'| <= scale_l / 2 (up to fp32 rounding)

How that maps into QuantizedTensor (quant/base.py):
    codes    = label * 256 + q        int64 in [0, 256 * K)
    n_levels = 256 * K
    codebook = min_l + j * scale_l    float32, materialised for every (l, j); dequantize is
                                      codebook[codes], the same arithmetic unpack() rebuilds
    side     = {"scale": (K,) fp32, "min": (K,) fp32}
    meta     = {"n_clusters", "mean", "std", "boundaries"}

Storage form (``pack``): labels as uint4 through codec/bitpack.py (two per byte, element 2j in
the low nibble and 2j+1 in the high nibble, a zero high nibble pads an odd count); values as one
uint8 per element; per cluster fp32 scale and min, little-endian. That is 1.5 bytes per element + 8 K bytes, ~2.67x for
fp32 (the paper's figure). Shape and dtype are kept by the caller's record header.

Call order::

    q = quantize(x, Cluster8Config())     # -> QuantizedTensor
    blobs = pack(q)                       # -> {"labels", "values", "scale", "min"}: bytes
    q2 = unpack(blobs, shape, dtype)      # -> QuantizedTensor equal to q for dequantize
    y = dequantize(q2)                    # x's shape and dtype

The paper's naive baseline, one min-max uint8 grid over the whole tensor, is K = 1
(bench/paper_baselines.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import bitpack
from ..codec import stages as S
from ..configcheck import Range, check_fields
from ..errors import ConfigError, CorruptCheckpointError
from ..tensorbytes import FLOAT_DTYPES, dtype_name, torch_dtype
from .base import QuantizedTensor, apply_codebook, flat_float32

DESCRIPTOR = S.CLUSTER8.descriptor
_LEVELS = 256  # uint8 grid per cluster
_MAX_CLUSTERS = 16  # labels are stored as uint4
N_CLUSTERS = Range(ge=1, le=_MAX_CLUSTERS, note=" (labels are uint4)")


@dataclass(frozen=True)
class Cluster8Config:
    n_clusters: int = 16  # clusters at the fitted normal's quantiles; <= 16 so labels fit in 4 bits

    def __post_init__(self):
        check_fields(self, n_clusters=N_CLUSTERS)


# --------------------------------------------------------------------------- quantize / dequantize
def normal_boundaries(mean: float, std: float, n_clusters: int) -> torch.Tensor:
    """(K-1,) float64 cut points mu + sigma * Phi^-1(i/K), i = 1..K-1 (equal-mass under N(mu, sigma))."""
    p = torch.arange(1, n_clusters, dtype=torch.float64) / n_clusters
    return mean + std * torch.special.ndtri(p)


def quantize(x: torch.Tensor, config: Cluster8Config = Cluster8Config()) -> QuantizedTensor:
    """Cluster-based uint8 quantization of a float tensor (computed in fp32 on x's device)."""
    if not isinstance(config, Cluster8Config):
        raise ConfigError(f"config must be a Cluster8Config, got {type(config).__name__}")
    xf = flat_float32(x, "cluster8")  # (n,)
    K = config.n_clusters
    if xf.numel():
        xd = xf.double()
        mean, std = float(xd.mean()), float(xd.std(unbiased=False))
    else:
        mean, std = 0.0, 0.0
    bounds = normal_boundaries(mean, std, K).to(torch.float32)  # (K-1,)
    labels = torch.bucketize(xf, bounds.to(xf.device), right=False)  # (n,) in [0, K)
    q, cmin, scale = _minmax_uint8(xf, labels, K)
    codes = labels * _LEVELS + q
    return QuantizedTensor(
        codes=codes,
        n_levels=_LEVELS * K,
        codebook=_codebook(cmin, scale),
        shape=tuple(x.shape),
        dtype=dtype_name(x.dtype),
        side={"scale": scale, "min": cmin},
        meta={"descriptor": DESCRIPTOR, "n_clusters": K, "mean": mean, "std": std,
              "boundaries": [float(b) for b in bounds]},
    )


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """codebook[codes] reshaped to the original shape and cast to the original dtype."""
    return apply_codebook(q.codes, q.codebook).reshape(q.shape).to(torch_dtype(q.dtype))


# --------------------------------------------------------------------------- storage form
def packed_nbytes(n: int, n_clusters: int) -> int:
    """Bytes of pack()'s output: ceil(n/2) labels + n values + 8 per cluster (scale, min)."""
    return (n + 1) // 2 + n + 8 * n_clusters


def pack(q: QuantizedTensor) -> dict[str, bytes]:
    """Storage form: {"labels": uint4 x2 per byte, "values": uint8, "scale"/"min": fp32 per cluster}."""
    codes = q.codes.reshape(-1)
    labels = (codes // _LEVELS).to(torch.uint8)
    values = (codes % _LEVELS).to(torch.uint8)
    return {
        "labels": bitpack.pack(labels, 4).cpu().numpy().tobytes(),  # element 2j low nibble, 2j+1 high
        "values": values.cpu().numpy().tobytes(),
        "scale": q.side["scale"].to(torch.float32).cpu().numpy().astype("<f4").tobytes(),
        "min": q.side["min"].to(torch.float32).cpu().numpy().astype("<f4").tobytes(),
    }


def unpack(blobs: dict[str, bytes], shape, dtype: str, device: torch.device | str = "cpu") -> QuantizedTensor:
    """Inverse of pack(); shape and dtype come from the caller's record header."""
    try:
        lab_b, val_b, scale_b, min_b = (blobs[k] for k in ("labels", "values", "scale", "min"))
    except KeyError as e:
        raise CorruptCheckpointError(f"cluster8 record lacks the {e.args[0]!r} blob") from None
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if dtype not in FLOAT_DTYPES:
        raise CorruptCheckpointError(f"cluster8 record names non-float dtype {dtype!r}")
    if len(scale_b) != len(min_b) or len(scale_b) % 4 or not 1 <= len(scale_b) // 4 <= _MAX_CLUSTERS:
        raise CorruptCheckpointError(
            f"cluster8 scale/min blobs have {len(scale_b)}/{len(min_b)} bytes; expected equal, 4 x K with K in [1, 16]"
        )
    K = len(scale_b) // 4
    if len(lab_b) != (n + 1) // 2 or len(val_b) != n:
        raise CorruptCheckpointError(
            f"cluster8 labels/values have {len(lab_b)}/{len(val_b)} bytes, expected {(n + 1) // 2}/{n} for {n} elements"
        )
    labels = bitpack.unpack(lab_b, n, 4).long()  # a set padding nibble raises
    if n and int(labels.max()) >= K:
        raise CorruptCheckpointError(f"cluster8 label {int(labels.max())} out of range for {K} clusters")
    values = torch.from_numpy(np.frombuffer(val_b, dtype=np.uint8).copy()).long()
    scale = torch.from_numpy(np.frombuffer(scale_b, dtype="<f4").astype(np.float32))
    cmin = torch.from_numpy(np.frombuffer(min_b, dtype="<f4").astype(np.float32))
    if not (torch.isfinite(scale).all() and torch.isfinite(cmin).all()):
        raise CorruptCheckpointError("cluster8 scale/min hold inf or NaN; the record is corrupt")
    device = torch.device(device)
    scale, cmin = scale.to(device), cmin.to(device)
    return QuantizedTensor(
        codes=(labels * _LEVELS + values).to(device),
        n_levels=_LEVELS * K,
        codebook=_codebook(cmin, scale),
        shape=shape,
        dtype=dtype,
        side={"scale": scale, "min": cmin},
        meta={"descriptor": DESCRIPTOR, "n_clusters": K},
    )


# --------------------------------------------------------------------------- helpers
def _minmax_uint8(xf: torch.Tensor, labels: torch.Tensor, K: int):
    """Per-cluster asymmetric uint8: returns (q int64 (n,), min (K,) fp32, scale (K,) fp32)."""
    inf = torch.full((K,), float("inf"), dtype=torch.float32, device=xf.device)
    cmin = inf.scatter_reduce(0, labels, xf, reduce="amin", include_self=True)
    cmax = (-inf).scatter_reduce(0, labels, xf, reduce="amax", include_self=True)
    empty = torch.isinf(cmin)
    cmin = torch.where(empty, torch.zeros_like(cmin), cmin)
    cmax = torch.where(empty, torch.zeros_like(cmax), cmax)
    scale = (cmax - cmin) / (_LEVELS - 1)
    # a one-valued cluster has scale 0: every element is exactly min, so q = 0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - cmin[labels]) / safe[labels]).clamp_(0, _LEVELS - 1)
    q = torch.where(scale[labels] > 0, q, torch.zeros_like(q)).to(torch.int64)
    return q, cmin, scale


def _codebook(cmin: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(K * 256,) fp32: entry l*256 + j = min_l + j * scale_l (one definition for quantize and unpack)."""
    j = torch.arange(_LEVELS, dtype=torch.float32, device=cmin.device)
    return (cmin[:, None] + j[None, :] * scale[:, None]).reshape(-1)
