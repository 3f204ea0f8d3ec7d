"""ExCP tensor core: residual, weight-momentum joint pruning, k-means quantization of each part.

ExCP (Li et al., 2024, paper 003) compresses one parameter tensor of checkpoint t against
W~_{t-1}, the *reconstructed* previous weights. The definitions follow the authors' public code
(compress_pythia.py), since the paper's equations did not survive text extraction:

1. Residual ``dW = W_t - W~_{t-1}``, always in float32 (the authors subtract in the weight dtype;
   bf16 - bf16 would already round the residual).
2. Weight mask, eq. 5 ("M2W", momentum-to-weight)::

       f      = min(2.5, alpha / sqrt(mean(v)))      # mean(v): one scalar over the tensor's exp_avg_sq
       w_mask = |dW| > f * median(|dW|)              # strict >, median = LOWER middle (torch.median)

   If ``mean(v) == 0`` (a parameter that never saw a gradient) alpha/sqrt(0) is +inf, so
   ``f = 2.5``: the cap, which is what the authors' ``min(2.5, inf)`` evaluates to as well.
3. Momentum mask, eq. 6 ("W2M", weight-to-momentum)::

       m_mask = (|m| > beta * mean(|m|)) & w_mask    # m = exp_avg
       m' = m * m_mask;  v' = v * m_mask             # v = exp_avg_sq, same mask; both stored directly

4. Each of dW', m', v' is quantized on its own: the non-zeros go through 1-D k-means with
   ``2**bits - 1`` centers, code 0 is reserved for an exact zero. A part with at most
   ``2**bits - 1`` non-zeros is stored dense float32 instead (the authors keep it unquantized too:
   k-means would be pointless). In blob form the codes are packed ``8 // bits`` per byte by
   codec/bitpack.py (LSB first; ckptzip 0.1 packed the FIRST code in the HIGH bits: meta format
   ``excp-tensor/1``, still read).
5. The methods compress the container of all records with LZMA2 (codec/frames.py xz, preset
   9 | EXTREME; the paper uses 7-Zip "ultra", which is LZMA2 as well).

K-means. The authors call ``faiss.Kmeans(1, 15)``: faiss defaults to 25 Lloyd iterations, seed 1234,
random-sample init, and trains on a subsample of at most 256 points per centroid (3,840 for 15
centers) before assigning every value. Here, in plain torch (runs on CUDA unchanged): k-means++
init drawn with a seeded CPU ``torch.Generator`` (uniforms generated on CPU, so CPU and CUDA pick
the same seeds), then exact Lloyd iterations on ALL values, capped at ``kmeans_max_iter`` (default 50)
and stopped as soon as the assignment stops changing. In 1-D every cluster is a contiguous run of
the sorted values, so one sort plus a float64 prefix sum makes each Lloyd step O(k log n)
(``searchsorted`` for the k-1 midpoints) and deterministic (no atomics). An empty cluster keeps its
center. Ties (a value exactly on a midpoint) go to the lower center.

Known defect of the faithful variant (``codebook_dtype="float16"``, as the authors store it):
exp_avg_sq centers are typically 1e-10..1e-4, all below fp16's smallest normal (6.1e-5), so they
land on the subnormal grid of step 2**-24 ~ 6e-8; every center below 2**-25 ~ 3e-8 becomes exactly
0 and an Adam update m / (sqrt(v) + eps) then divides by eps alone. ``codebook_dtype="float32"``
(``excp-fixed``'s default) keeps them.

Call order (what methods/excp.py does per parameter tensor; excp_fixed.py keeps the parts
unpacked, ``encode_parts`` / ``decode_parts``, and codes their codes in sub-streams)::

    dw = residual(w_t, w_prev_hat)                       # float32
    blobs, meta = encode_tensor(dw, exp_avg, exp_avg_sq, config)
    ...store blobs (dict of bytes) + meta (JSON-able) in the xz payload...
    dw_hat, m_hat, v_hat = decode_tensor(blobs, meta)    # zeros where pruned
    w_hat = apply_residual(w_prev_hat, dw_hat)           # next reference, in the weight dtype
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codec import bitpack
from ..codec import stages as S
from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError, CorruptCheckpointError, NonFiniteError, UnsupportedStateError, malformed
from ..tensorbytes import dtype_name, tensor_from_bytes, tensor_to_bytes, torch_dtype
from .base import QuantizedTensor, apply_codebook

FORMAT = S.EXCP_TENSOR.descriptor        # written into every tensor's meta: codes packed by codec/bitpack.py
FORMAT_V1 = S.EXCP_TENSOR_V1.descriptor  # ckptzip 0.1: codes packed MSB first (read only)
PARTS = ("dw", "m", "v")     # residual, exp_avg, exp_avg_sq
_CODEBOOK_DTYPES = ("float16", "float32")
RULES = dict(alpha=Range(gt=0, lt=math.inf, note=" (paper: 5e-5)"), beta=Range(ge=0, lt=math.inf, note=" (paper: 2.0)"),
             bits=OneOf(bitpack.WIDTHS, " (paper: 4)"), codebook_dtype=OneOf(_CODEBOOK_DTYPES), seed=Range(ge=0),
             kmeans_max_iter=Range(ge=1))  # ExcpConfig's fields, shared by methods/excp_fixed.ExcpFixedConfig


@dataclass(frozen=True)
class ExcpConfig:
    alpha: float = 5e-5              # eq. 5: weight threshold factor f = min(2.5, alpha / sqrt(mean(v)))
    beta: float = 2.0                # eq. 6: keep momentum where |m| > beta * mean(|m|)
    bits: int = 4                    # code width: 2**bits - 1 k-means centers + code 0 for zero
    codebook_dtype: str = "float16"  # "float16" as the authors store it; "float32" fixes the v flush
    seed: int = 0                    # k-means++ seed (same seed -> same bytes)
    kmeans_max_iter: int = 50        # Lloyd iteration cap (stops earlier once assignments settle)

    def __post_init__(self):
        check_fields(self, **RULES)


EXCP_FAITHFUL = ExcpConfig()  # the authors' recipe, fp16 codebooks included


# ---------------------------------------------------------------------------------------------
# residual
# ---------------------------------------------------------------------------------------------
def residual(weight: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """dW = W_t - W~_{t-1} in float32, whatever the weight dtype (bf16 - bf16 would round it)."""
    if weight.shape != reference.shape:
        raise ValueError(f"weight shape {tuple(weight.shape)} != reference shape {tuple(reference.shape)}")
    return weight.to(torch.float32) - reference.to(torch.float32)


def apply_residual(reference: torch.Tensor, dw_hat: torch.Tensor) -> torch.Tensor:
    """W~_t = W~_{t-1} + dW^ computed in float32, returned in the reference's dtype."""
    if reference.shape != dw_hat.shape:
        raise ValueError(f"reference shape {tuple(reference.shape)} != residual shape {tuple(dw_hat.shape)}")
    return (reference.to(torch.float32) + dw_hat.to(reference.device, torch.float32)).to(reference.dtype)


# ---------------------------------------------------------------------------------------------
# pruning (eq. 5 and 6)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PruneResult:
    w_mask: torch.Tensor   # bool, dW's shape: residual entries kept
    m_mask: torch.Tensor   # bool, dW's shape: exp_avg / exp_avg_sq entries kept (subset of w_mask)
    f: float               # min(2.5, alpha / sqrt(mean(v)))
    threshold: float       # f * median(|dW|): keep |dW| > threshold
    m_threshold: float     # beta * mean(|m|): keep |m| > m_threshold


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteError(f"{name} holds inf or NaN; ExCP needs finite values (check the run for divergence)")


def _check_same_shape(dw: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    if not (dw.shape == m.shape == v.shape):
        raise ValueError(
            f"dW, exp_avg and exp_avg_sq must share one shape, got {tuple(dw.shape)}, {tuple(m.shape)}, "
            f"{tuple(v.shape)}"
        )


def prune(dw: torch.Tensor, m: torch.Tensor, v: torch.Tensor, config: ExcpConfig = EXCP_FAITHFUL) -> PruneResult:
    """Both ExCP masks and the thresholds behind them (see the module docstring for the formulas)."""
    _check_same_shape(dw, m, v)
    for name, t in (("dW", dw), ("exp_avg", m), ("exp_avg_sq", v)):
        _check_finite(name, t)
    dw32, m32, v32 = dw.to(torch.float32), m.to(torch.float32), v.to(torch.float32)
    mean_v = float(v32.mean()) if v32.numel() else 0.0
    if mean_v < 0:
        raise UnsupportedStateError(f"exp_avg_sq has a negative mean ({mean_v}): not an Adam second moment; "
                                    "store this state with another method (e.g. lossless)")
    # mean(v) == 0 -> alpha / 0 = inf -> the 2.5 cap, as min(2.5, inf) gives in the authors' code
    f = 2.5 if mean_v == 0 else min(2.5, config.alpha / math.sqrt(mean_v))
    abs_dw = dw32.abs()
    if dw32.numel():
        thr = abs_dw.reshape(-1).median() * f  # lower median; float32 product as in the authors' code
        m_thr = m32.abs().mean() * config.beta
    else:
        thr = m_thr = torch.zeros((), dtype=torch.float32, device=dw.device)
    w_mask = abs_dw > thr
    m_mask = (m32.abs() > m_thr) & w_mask
    return PruneResult(w_mask, m_mask, f, float(thr), float(m_thr))


def prune_masks(dw: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                config: ExcpConfig = EXCP_FAITHFUL) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_mask, m_mask): eq. 5 and eq. 6 masks, bool tensors of dW's shape."""
    r = prune(dw, m, v, config)
    return r.w_mask, r.m_mask


# ---------------------------------------------------------------------------------------------
# 1-D k-means
# ---------------------------------------------------------------------------------------------
def _kmeans_1d(xs: torch.Tensor, k: int, seed: int, max_iter: int) -> torch.Tensor:
    """Sorted float64 centers (k,) of sorted float64 values xs (n >= 1,)."""
    n = xs.numel()
    # uniforms on CPU: the same seed picks the same init points on every device
    u = torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(xs.device)
    centers = torch.empty(k, dtype=torch.float64, device=xs.device)
    centers[0] = xs[(u[0] * n).long().clamp_(max=n - 1)]
    d2 = (xs - centers[0]).square_()
    for j in range(1, k):  # k-means++: draw the next center with probability ~ D(x)^2
        cum = torch.cumsum(d2, 0)
        # total == 0 (fewer distinct values than k): t = 0 and right-side search takes index 0,
        # a duplicate center that simply stays empty
        idx = torch.searchsorted(cum, (u[j] * cum[-1]).reshape(1), right=True).clamp_(max=n - 1)
        centers[j] = xs[idx[0]]
        d2 = torch.minimum(d2, (xs - centers[j]).square_())
    del d2
    centers = centers.sort().values
    prefix = torch.cat([xs.new_zeros(1), torch.cumsum(xs, 0)])  # prefix[i] = sum(xs[:i])
    prev = None
    for _ in range(max_iter):
        mids = (centers[:-1] + centers[1:]) * 0.5
        # cluster j = {b_{j-1} < x <= b_j}: split = number of values <= each midpoint
        split = torch.searchsorted(xs, mids, right=True)
        if prev is not None and torch.equal(split, prev):
            break  # assignments settled: the centers are their clusters' means already
        bounds = torch.cat([split.new_zeros(1), split, split.new_full((1,), n)])
        counts = (bounds[1:] - bounds[:-1]).to(torch.float64)
        sums = prefix[bounds[1:]] - prefix[bounds[:-1]]
        centers = torch.where(counts > 0, sums / counts.clamp(min=1), centers).sort().values
        prev = split
    return centers


def _assign(x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
    """Index of the nearest sorted center for each value (ties to the lower one), int64."""
    mids = (centers[:-1] + centers[1:]) * 0.5
    return torch.searchsorted(mids, x.to(torch.float64).contiguous(), right=False)


def kmeans_quantize(values: torch.Tensor, bits: int = 4, seed: int = 0,
                    max_iter: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D k-means of ``values`` (the non-zeros) into 2**bits - 1 centers.

    Returns (codes, centers): codes (n,) uint8 in 1..2**bits-1, values' flat order, code c meaning
    centers[c - 1]; centers (2**bits - 1,) float32 ascending.
    """
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ConfigError(f"bits must be an int in 1..8, got {bits!r}")
    if not (isinstance(max_iter, int) and max_iter >= 1):
        raise ConfigError(f"max_iter must be an int >= 1, got {max_iter!r}")
    x = values.detach().reshape(-1)
    if x.numel() == 0:
        raise ValueError("kmeans_quantize needs at least one value; store an all-zero part without k-means")
    _check_finite("k-means input", x)
    k = 2 ** bits - 1
    centers = _kmeans_1d(x.to(torch.float64).sort().values, k, seed, max_iter)
    codes = (_assign(x, centers) + 1).to(torch.uint8)
    return codes, centers.to(torch.float32)


def quantize_nonzeros(x: torch.Tensor, *, bits: int = 4, seed: int = 0, codebook_dtype: str = "float32",
                      max_iter: int = 50) -> QuantizedTensor:
    """k-means-quantize the non-zeros of x; zeros get code 0.

    codebook (2**bits,) float32 = [0, centers rounded through codebook_dtype]: exactly what a reader
    of the stored codebook recovers (so a float16 codebook shows its flushed centers here too).
    """
    if codebook_dtype not in _CODEBOOK_DTYPES:
        raise ConfigError(f"codebook_dtype must be one of {_CODEBOOK_DTYPES}, got {codebook_dtype!r}")
    flat = x.detach().reshape(-1)
    nz = flat != 0
    codes = torch.zeros(flat.numel(), dtype=torch.int64, device=flat.device)
    nnz = int(nz.sum())
    if nnz:
        c, centers = kmeans_quantize(flat[nz], bits, seed, max_iter)
        codes[nz] = c.to(torch.int64)
    else:  # nothing to cluster: every center is 0 and no code but 0 is used
        centers = torch.zeros(2 ** bits - 1, dtype=torch.float32, device=flat.device)
    stored = centers.to(torch_dtype(codebook_dtype)).to(torch.float32)
    codebook = torch.cat([stored.new_zeros(1), stored])
    return QuantizedTensor(codes=codes, n_levels=2 ** bits, codebook=codebook, shape=tuple(x.shape),
                           dtype=dtype_name(x.dtype),
                           meta={"codebook_dtype": codebook_dtype, "nnz": nnz, "method": "kmeans1d/1"})


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Inverse of quantize_nonzeros: codebook[codes] in the original shape and dtype."""
    return apply_codebook(q.codes, q.codebook).reshape(q.shape).to(torch_dtype(q.dtype))


# ---------------------------------------------------------------------------------------------
# one parameter tensor: its parts
# ---------------------------------------------------------------------------------------------
@dataclass
class Part:
    """One part of a parameter: k-means codes + codebook bytes, or dense float32 bytes."""

    mode: str                          # "kmeans" | "dense"
    codes: torch.Tensor | None = None  # (n,) uint8 on CPU, code 0 = exact zero (kmeans)
    codebook: bytes = b""              # 2**bits - 1 centers in codebook_dtype, little-endian (kmeans)
    dense: bytes = b""                 # n float32, little-endian (dense)

    def support(self) -> torch.Tensor:
        """(n,) bool: where the part is non-zero."""
        if self.mode == "kmeans":
            return self.codes != 0
        return tensor_from_bytes(self.dense, "float32", (len(self.dense) // 4,)) != 0


def quantize_part(x: torch.Tensor, config: ExcpConfig) -> Part:
    """k-means of the non-zeros of x; at most 2**bits - 1 non-zeros are kept dense instead (too few
    for k-means to pay: the authors keep them unquantized too)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    if int((flat != 0).sum()) <= 2 ** config.bits - 1:
        return Part("dense", dense=tensor_to_bytes(flat))
    q = quantize_nonzeros(flat, bits=config.bits, seed=config.seed, codebook_dtype=config.codebook_dtype,
                          max_iter=config.kmeans_max_iter)
    return Part("kmeans", codes=q.codes.to(torch.uint8).cpu(),
                codebook=tensor_to_bytes(q.codebook[1:].to(torch_dtype(config.codebook_dtype))))


def part_values(part: Part, n: int, codebook_dtype: str, bits: int) -> torch.Tensor:
    """(n,) float32 on CPU: 0 for code 0, else the center as float32; or the dense values."""
    if part.mode == "dense":
        return tensor_from_bytes(part.dense, "float32", (n,))
    if part.mode != "kmeans":
        raise CorruptCheckpointError(f"ExCP part has unknown mode {part.mode!r}")
    centers = tensor_from_bytes(part.codebook, codebook_dtype, (2 ** bits - 1,))
    if part.codes is None or part.codes.shape != (n,):
        raise CorruptCheckpointError(f"ExCP part holds {None if part.codes is None else part.codes.numel()} codes, "
                                     f"expected {n}")
    return torch.cat([torch.zeros(1), centers.to(torch.float32)]).index_select(0, part.codes.long())


def encode_parts(dw: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 config: ExcpConfig = EXCP_FAITHFUL) -> tuple[dict[str, Part], dict]:
    """Prune + quantize one parameter's (residual, exp_avg, exp_avg_sq) into its parts dw, m, v.

    meta is JSON-able and holds everything decode_parts needs (format, shape, bits, codebook
    dtype, part modes, original m/v dtypes) plus pruning figures (f, thresholds, kept counts).
    """
    r = prune(dw, m, v, config)
    zero = torch.zeros((), dtype=torch.float32, device=dw.device)
    parts = {"dw": quantize_part(torch.where(r.w_mask, dw.to(torch.float32), zero), config),
             "m": quantize_part(torch.where(r.m_mask, m.to(torch.float32), zero), config),
             "v": quantize_part(torch.where(r.m_mask, v.to(torch.float32), zero), config)}
    meta = {
        "format": FORMAT,
        "shape": [int(s) for s in dw.shape],
        "bits": config.bits,
        "codebook_dtype": config.codebook_dtype,
        "dtypes": {"m": dtype_name(m.dtype), "v": dtype_name(v.dtype)},  # dW is always float32
        "prune": {"f": r.f, "threshold": r.threshold, "m_threshold": r.m_threshold,
                  "w_kept": int(r.w_mask.sum()), "m_kept": int(r.m_mask.sum()), "numel": dw.numel()},
        "parts": {p: {"mode": part.mode, "nnz": int(part.support().sum())} for p, part in parts.items()},
    }
    return parts, meta


def read_meta(meta: dict, formats: tuple[str, ...] = (FORMAT, FORMAT_V1)) -> tuple[tuple[int, ...], int, str]:
    """(shape, bits, codebook dtype) of a tensor meta, validated; CorruptCheckpointError if malformed."""
    with malformed("ExCP record meta"):
        if meta["format"] not in formats:
            raise CorruptCheckpointError(f"ExCP record has format {meta['format']!r}, this reader knows "
                                         f"{', '.join(formats)}")
        shape, bits, cb_dtype = tuple(int(s) for s in meta["shape"]), int(meta["bits"]), meta["codebook_dtype"]
        modes = {meta["parts"][p]["mode"] for p in meta["parts"]}
        for p in ("m", "v"):
            torch_dtype(meta["dtypes"][p])
    if bits not in bitpack.WIDTHS or cb_dtype not in _CODEBOOK_DTYPES or any(s < 0 for s in shape):
        raise CorruptCheckpointError(f"ExCP record meta has bits={bits}, codebook_dtype={cb_dtype!r}, shape={shape}")
    if not modes <= {"kmeans", "dense"}:
        raise CorruptCheckpointError(f"ExCP record meta has part modes {sorted(modes)}")
    return shape, bits, cb_dtype


def decode_parts(parts: dict[str, Part], meta: dict, device: torch.device | str = "cpu",
                 names: tuple[str, ...] = PARTS, formats: tuple[str, ...] = (FORMAT, FORMAT_V1)) -> list[torch.Tensor]:
    """The parts' values in meta's shape: dw float32, m and v in their recorded dtypes."""
    shape, bits, cb_dtype = read_meta(meta, formats)
    n = math.prod(shape)
    out = []
    for p in names:
        if p not in parts:
            raise CorruptCheckpointError(f"ExCP record lacks its part {p!r}")
        dtype = torch.float32 if p == "dw" else torch_dtype(meta["dtypes"][p])
        out.append(part_values(parts[p], n, cb_dtype, bits).reshape(shape).to(device=device, dtype=dtype))
    return out


# --- blob form: each part as p.codes (packed) + p.codebook, or p.dense ------------------------
def encode_tensor(dw: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  config: ExcpConfig = EXCP_FAITHFUL) -> tuple[dict[str, bytes], dict]:
    """:func:`encode_parts` with each part as blobs: ``p.codes`` (codec/bitpack.py, ``bits`` wide) +
    ``p.codebook`` (2**bits - 1 centers, codebook_dtype, little-endian), or ``p.dense`` (numel float32)."""
    parts, meta = encode_parts(dw, m, v, config)
    blobs: dict[str, bytes] = {}
    for p, part in parts.items():
        if part.mode == "dense":
            blobs[f"{p}.dense"] = part.dense
        else:
            blobs[f"{p}.codes"] = bitpack.pack(part.codes, config.bits).numpy().tobytes()
            blobs[f"{p}.codebook"] = part.codebook
    return blobs, meta


def parts_from_blobs(blobs: dict[str, bytes], meta: dict) -> dict[str, Part]:
    """Inverse of encode_tensor's blob form; codes unpacked LSB first (excp-tensor/2) or, in files of
    ckptzip 0.1 (excp-tensor/1), MSB first."""
    shape, bits, _ = read_meta(meta)
    n = math.prod(shape)
    unpack = bitpack.unpack if meta["format"] == FORMAT else bitpack.unpack_msb_first
    parts = {}
    for p in PARTS:
        if meta["parts"][p]["mode"] == "dense":
            parts[p] = Part("dense", dense=_blob(blobs, f"{p}.dense"))
        else:
            parts[p] = Part("kmeans", codes=unpack(_blob(blobs, f"{p}.codes"), n, bits),
                            codebook=_blob(blobs, f"{p}.codebook"))
    return parts


def decode_tensor(blobs: dict[str, bytes], meta: dict,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dW^ float32, m^, v^ in their original dtypes), zeros where pruned, all of meta's shape."""
    dw, m, v = decode_parts(parts_from_blobs(blobs, meta), meta, device)
    return dw, m, v


def _blob(blobs: dict, key: str) -> bytes:
    try:
        return blobs[key]
    except KeyError:
        raise CorruptCheckpointError(f"ExCP record lacks its {key!r} blob") from None
