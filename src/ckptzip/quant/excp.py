"""ExCP tensor core: residual, weight-momentum joint pruning, k-means quantization, nibble packing.

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
   ``2**bits - 1`` centers, code 0 is reserved for an exact zero, codes are packed ``8 // bits`` per
   byte with the FIRST element in the HIGH bits. A part with at most ``2**bits - 1`` non-zeros is
   stored dense float32 instead (the authors keep it unquantized too: k-means would be pointless).
5. The container of all records is compressed with LZMA2 (xz, preset 9 | EXTREME; the paper uses
   7-Zip "ultra", which is LZMA2 as well).

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
(``EXCP_FIXED``) keeps them.

Call order (what methods/excp.py does per parameter tensor)::

    dw = residual(w_t, w_prev_hat)                       # float32
    blobs, meta = encode_tensor(dw, exp_avg, exp_avg_sq, config)
    ...store blobs (dict of bytes) + meta (JSON-able), later lzma_compress(container)...
    dw_hat, m_hat, v_hat = decode_tensor(blobs, meta)    # zeros where pruned
    w_hat = apply_residual(w_prev_hat, dw_hat)           # next reference, in the weight dtype
"""
from __future__ import annotations

import lzma
import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError, CorruptCheckpointError, NonFiniteError
from ..tensorbytes import dtype_name, tensor_from_bytes, tensor_to_bytes, torch_dtype
from .base import QuantizedTensor, apply_codebook

FORMAT = "excp-tensor/1"  # written into every tensor's meta; decode_tensor refuses anything else
PARTS = ("dw", "m", "v")  # residual, exp_avg, exp_avg_sq
_CODEBOOK_DTYPES = ("float16", "float32")
_PACK_BITS = (1, 2, 4, 8)  # widths that tile a byte exactly


@dataclass(frozen=True)
class ExcpConfig:
    alpha: float = 5e-5              # eq. 5: weight threshold factor f = min(2.5, alpha / sqrt(mean(v)))
    beta: float = 2.0                # eq. 6: keep momentum where |m| > beta * mean(|m|)
    bits: int = 4                    # code width: 2**bits - 1 k-means centers + code 0 for zero
    codebook_dtype: str = "float16"  # "float16" as the authors store it; "float32" fixes the v flush
    seed: int = 0                    # k-means++ seed (same seed -> same bytes)
    kmeans_max_iter: int = 50        # Lloyd iteration cap (stops earlier once assignments settle)

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"ExcpConfig.alpha must be a finite number > 0 (paper: 5e-5), got {self.alpha}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ConfigError(f"ExcpConfig.beta must be a finite number >= 0 (paper: 2.0), got {self.beta}")
        if self.bits not in _PACK_BITS:
            raise ConfigError(f"ExcpConfig.bits must be one of {_PACK_BITS} (paper: 4), got {self.bits}")
        if self.codebook_dtype not in _CODEBOOK_DTYPES:
            raise ConfigError(
                f"ExcpConfig.codebook_dtype must be one of {_CODEBOOK_DTYPES}, got {self.codebook_dtype!r}"
            )
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise ConfigError(f"ExcpConfig.seed must be an int >= 0, got {self.seed!r}")
        if not (isinstance(self.kmeans_max_iter, int) and self.kmeans_max_iter >= 1):
            raise ConfigError(f"ExcpConfig.kmeans_max_iter must be an int >= 1, got {self.kmeans_max_iter!r}")


EXCP_FAITHFUL = ExcpConfig()                        # the authors' recipe, fp16 codebooks included
EXCP_FIXED = ExcpConfig(codebook_dtype="float32")   # same, with codebooks that keep small v centers


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
        raise ValueError(f"exp_avg_sq has a negative mean ({mean_v}); pass the optimizer's second moment")
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
# packing
# ---------------------------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Pack codes (< 2**bits) 8 // bits per byte, FIRST element in the HIGHEST bits; pad with 0."""
    if bits not in _PACK_BITS:
        raise ConfigError(f"bits must be one of {_PACK_BITS} to pack whole bytes, got {bits!r}")
    c = codes.detach().reshape(-1)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 2 ** bits):
        raise ValueError(f"codes must lie in [0, {2 ** bits - 1}] for {bits}-bit packing")
    c = c.to(torch.uint8)
    per = 8 // bits
    pad = (-c.numel()) % per
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.reshape(-1, per)  # (n_bytes, per)
    out = torch.zeros(c.shape[0], dtype=torch.uint8, device=c.device)
    for i in range(per):
        out |= c[:, i] << (bits * (per - 1 - i))
    return tensor_to_bytes(out)


def unpack_codes(buf: bytes | bytearray | memoryview, n: int, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: (n,) uint8 on CPU. Raises CorruptCheckpointError on a wrong length."""
    if bits not in _PACK_BITS:
        raise ConfigError(f"bits must be one of {_PACK_BITS} to unpack whole bytes, got {bits!r}")
    per = 8 // bits
    n_bytes = -(-n // per)
    if n < 0 or len(buf) != n_bytes:
        raise CorruptCheckpointError(f"packed codes hold {len(buf)} bytes, expected {n_bytes} for {n} {bits}-bit codes")
    b = tensor_from_bytes(bytes(buf), "uint8", (n_bytes,))
    mask = 2 ** bits - 1
    cols = [(b >> (bits * (per - 1 - i))) & mask for i in range(per)]
    return torch.stack(cols, dim=1).reshape(-1)[:n].contiguous()


def pack_nibbles(codes: torch.Tensor) -> bytes:
    """Two 4-bit codes per byte, first in the high nibble; an odd tail gets a 0 low nibble."""
    return pack_codes(codes, 4)


def unpack_nibbles(buf: bytes | bytearray | memoryview, n: int) -> torch.Tensor:
    """Inverse of pack_nibbles: (n,) uint8."""
    return unpack_codes(buf, n, 4)


# ---------------------------------------------------------------------------------------------
# one parameter tensor
# ---------------------------------------------------------------------------------------------
def _encode_part(name: str, x: torch.Tensor, config: ExcpConfig, blobs: dict[str, bytes]) -> dict:
    """Store one pruned part (zeros where pruned) as packed codes + codebook, or dense float32."""
    flat = x.reshape(-1)
    nnz = int((flat != 0).sum())
    if nnz <= 2 ** config.bits - 1:  # too few values for k-means to pay: keep them exact
        blobs[f"{name}.dense"] = tensor_to_bytes(flat.to(torch.float32))
        return {"mode": "dense", "nnz": nnz}
    q = quantize_nonzeros(flat, bits=config.bits, seed=config.seed, codebook_dtype=config.codebook_dtype,
                          max_iter=config.kmeans_max_iter)
    blobs[f"{name}.codes"] = pack_codes(q.codes, config.bits)
    blobs[f"{name}.codebook"] = tensor_to_bytes(q.codebook[1:].to(torch_dtype(config.codebook_dtype)))
    return {"mode": "kmeans", "nnz": nnz}


def encode_tensor(dw: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                  config: ExcpConfig = EXCP_FAITHFUL) -> tuple[dict[str, bytes], dict]:
    """Prune + quantize one parameter's (residual, exp_avg, exp_avg_sq).

    Returns (blobs, meta). blobs holds, for each part p in ("dw", "m", "v"), either
    ``p.codes`` (packed, numel codes) + ``p.codebook`` (2**bits - 1 centers, codebook_dtype,
    little-endian) or ``p.dense`` (numel float32). meta is JSON-able and holds everything
    decode_tensor needs (format, shape, bits, codebook dtype, part modes, original m/v dtypes)
    plus pruning figures (f, thresholds, kept counts) for reports.
    """
    r = prune(dw, m, v, config)
    zero = torch.zeros((), dtype=torch.float32, device=dw.device)
    parts = {
        "dw": torch.where(r.w_mask, dw.to(torch.float32), zero),
        "m": torch.where(r.m_mask, m.to(torch.float32), zero),
        "v": torch.where(r.m_mask, v.to(torch.float32), zero),
    }
    blobs: dict[str, bytes] = {}
    meta = {
        "format": FORMAT,
        "shape": [int(s) for s in dw.shape],
        "bits": config.bits,
        "codebook_dtype": config.codebook_dtype,
        "dtypes": {"m": dtype_name(m.dtype), "v": dtype_name(v.dtype)},  # dW is always float32
        "prune": {"f": r.f, "threshold": r.threshold, "m_threshold": r.m_threshold,
                  "w_kept": int(r.w_mask.sum()), "m_kept": int(r.m_mask.sum()), "numel": dw.numel()},
        "parts": {},
    }
    for name in PARTS:
        meta["parts"][name] = _encode_part(name, parts[name], config, blobs)
    return blobs, meta


def _blob(blobs: dict, key: str) -> bytes:
    try:
        return blobs[key]
    except KeyError:
        raise CorruptCheckpointError(f"ExCP record lacks its {key!r} blob") from None


def decode_tensor(blobs: dict[str, bytes], meta: dict,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dW^ float32, m^, v^ in their original dtypes), zeros where pruned, all of meta's shape."""
    try:
        if meta["format"] != FORMAT:
            raise CorruptCheckpointError(f"ExCP record has format {meta['format']!r}, this reader knows {FORMAT!r}")
        shape = tuple(int(s) for s in meta["shape"])
        bits = int(meta["bits"])
        cb_dtype = meta["codebook_dtype"]
        dtypes = {"dw": "float32", "m": meta["dtypes"]["m"], "v": meta["dtypes"]["v"]}
        modes = {name: meta["parts"][name]["mode"] for name in PARTS}
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"ExCP record meta is malformed ({e!r})") from None
    if bits not in _PACK_BITS or cb_dtype not in _CODEBOOK_DTYPES or any(s < 0 for s in shape):
        raise CorruptCheckpointError(f"ExCP record meta has bits={bits}, codebook_dtype={cb_dtype!r}, shape={shape}")
    n = math.prod(shape)
    out = []
    for name in PARTS:
        if modes[name] == "dense":
            x = tensor_from_bytes(_blob(blobs, f"{name}.dense"), "float32", (n,))
        elif modes[name] == "kmeans":
            codes = unpack_codes(_blob(blobs, f"{name}.codes"), n, bits)
            centers = tensor_from_bytes(_blob(blobs, f"{name}.codebook"), cb_dtype, (2 ** bits - 1,))
            table = torch.cat([torch.zeros(1), centers.to(torch.float32)])
            x = table[codes.long()]
        else:
            raise CorruptCheckpointError(f"ExCP part {name!r} has unknown mode {modes[name]!r}")
        try:
            dt = torch_dtype(dtypes[name])
        except TypeError as e:
            raise CorruptCheckpointError(str(e)) from None
        out.append(x.reshape(shape).to(device=device, dtype=dt))
    return out[0], out[1], out[2]


# ---------------------------------------------------------------------------------------------
# final stage
# ---------------------------------------------------------------------------------------------
_MAX_DICT = 64 << 20  # preset 9's dictionary


def lzma_compress(payload: bytes) -> bytes:
    """xz container, LZMA2 preset 9 | EXTREME (the paper's 7-Zip ultra is LZMA2 too).

    The dictionary is shrunk to the payload's size (power of two, >= 4 KiB): a dictionary larger
    than the input finds nothing more, but preset 9 would allocate ~670 MiB for it.
    """
    dict_size = min(_MAX_DICT, max(4096, 1 << max(0, len(payload) - 1).bit_length()))
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": dict_size}]
    return lzma.compress(payload, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)


def lzma_decompress(blob: bytes, max_bytes: int | None = None) -> bytes:
    """Inverse of lzma_compress; CorruptCheckpointError on damage or on output beyond max_bytes."""
    d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        out = d.decompress(blob, max_length=-1 if max_bytes is None else max_bytes + 1)
    except lzma.LZMAError as e:
        raise CorruptCheckpointError(f"LZMA stream is damaged ({e})") from None
    if max_bytes is not None and len(out) > max_bytes:
        raise CorruptCheckpointError(f"LZMA stream expands beyond max_bytes={max_bytes}")
    if not d.eof:
        raise CorruptCheckpointError("LZMA stream is truncated")
    if d.unused_data:
        raise CorruptCheckpointError(f"LZMA stream is followed by {len(d.unused_data)} stray bytes")
    return out
