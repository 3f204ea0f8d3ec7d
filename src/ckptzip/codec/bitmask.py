"""Lossless bitmask sparsification of a tensor against a base tensor (BitSnap §3.3, Algo. 1).

Between two checkpoints only some elements change. An element counts as *changed* when its bit
pattern differs from the base (integer views are compared, so -0.0 vs 0.0 and distinct NaN
payloads are told apart and restored exactly). A changed tensor is stored as

    payload = packed bitmask (ceil(n/8) bytes) || changed values (k * width bytes)

The bitmask has one bit per element in flat row-major order, packed *little-endian within each
byte*: bit ``i`` (value ``1 << i``) of byte ``j`` is element ``8*j + i``; padding bits of the last
byte are zero (this equals ``numpy.packbits(mask, bitorder="little")``). The values are the raw
little-endian bytes of the *current* elements (not differences), so decoding is a bit-exact
scatter into a copy of the base.

Break-even (paper Eq. 2, generalised): with ``n`` elements of ``w`` bytes and ``k`` changed,

    dense   = n * w
    bitmask = ceil(n / 8) + k * w        -> smaller than dense iff k/n < 1 - 1/(8 w)
    coo     = k * (4 + w)                (int32 index + value per change)

so the bitmask wins below 93.75 % changed for 2-byte floats (fp16/bf16, the paper's figure),
96.875 % for fp32 and 98.4375 % for fp64; COO beats the bitmask only below k/n = 1/32 = 3.125 %.
``encode_delta`` decides per tensor on the exact byte counts, not on the asymptotic fraction.

Call order::

    kind, payload, meta = encode_delta(cur, base)      # kind in {"same", "bitmask", "dense"}
    cur2 = decode_delta(kind, payload, base, meta)     # bit-identical to cur

The sparse-matrix (COO) baseline that the benchmark compares with is bench/paper_baselines.py.
"""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..tensorbytes import BITS_DTYPE, DTYPES, dtype_name, tensor_from_bytes, tensor_to_bytes
from . import bitpack

KINDS = ("same", "bitmask", "dense")
_COO_INDEX_BYTES = 4  # int32 little-endian element index (COO's size, for comparison)


# --------------------------------------------------------------------------- sizes / break-even
def break_even_fraction(dtype: torch.dtype | str) -> float:
    """Changed fraction below which the packed bitmask beats dense storage: 1 - 1/(8 * width)."""
    width = _width(dtype)
    return 1.0 - 1.0 / (8 * width)


def encoded_sizes(n: int, k: int, width: int) -> dict[str, int]:
    """Exact payload bytes of each representation for n elements of `width` bytes, k changed."""
    return {
        "dense": n * width,
        "bitmask": math.ceil(n / 8) + k * width,
        "coo": k * (_COO_INDEX_BYTES + width),
    }


def changed_mask(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """(n,) bool, True where the bit patterns of cur and base differ (flat row-major)."""
    _check_pair(cur, base)
    return _bits(cur) != _bits(base)


# --------------------------------------------------------------------------- bit packing
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """(n,) bool -> (ceil(n/8),) uint8: codec/bitpack.py at 1 bit (LSB first, zero padding)."""
    return bitpack.pack(mask.reshape(-1).to(torch.bool), 1)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_bits: (ceil(n/8),) uint8 -> (n,) bool. Raises if padding bits are set."""
    return bitpack.unpack(packed, n, 1).to(torch.bool)


# --------------------------------------------------------------------------- bitmask delta
def encode_delta(cur: torch.Tensor, base: torch.Tensor) -> tuple[str, bytes, dict]:
    """Encode `cur` against `base` losslessly; picks the smallest of "same", "bitmask", "dense".

    Returns (kind, payload, meta); meta is JSON-able: shape, dtype, n_changed, and the byte counts
    of both candidates (for reports). Tensors may live on any device; the payload is host bytes.
    """
    mask = changed_mask(cur, base)
    n = mask.numel()
    k = int(mask.sum())
    width = cur.element_size()
    sizes = encoded_sizes(n, k, width)
    meta = {
        "shape": list(cur.shape),
        "dtype": dtype_name(cur.dtype),
        "n_changed": k,
        "dense_bytes": sizes["dense"],
        "bitmask_bytes": sizes["bitmask"],
    }
    if k == 0:
        return "same", b"", meta
    if sizes["bitmask"] < sizes["dense"]:
        values = cur.detach().reshape(-1)[mask]
        payload = pack_bits(mask).cpu().numpy().tobytes() + tensor_to_bytes(values)
        return "bitmask", payload, meta
    return "dense", tensor_to_bytes(cur), meta


def decode_delta(kind: str, payload: bytes, base: torch.Tensor, meta: dict) -> torch.Tensor:
    """Rebuild the current tensor from encode_delta's output and the same base (bit-exact).

    The result is a new tensor on base's device with base's shape and dtype.
    """
    n, width = _check_meta(base, meta)
    if kind == "same":
        if len(payload):
            raise CorruptCheckpointError(f"a 'same' delta must have an empty payload, got {len(payload)} bytes")
        return base.detach().clone()
    if kind == "dense":
        out = tensor_from_bytes(payload, meta["dtype"], base.shape)
        return out.to(base.device)
    if kind != "bitmask":
        raise CorruptCheckpointError(f"unknown delta kind {kind!r}; expected one of {KINDS}")
    n_mask = math.ceil(n / 8)
    if len(payload) < n_mask:
        raise CorruptCheckpointError(f"bitmask payload has {len(payload)} bytes, needs at least {n_mask} for the mask")
    packed = torch.frombuffer(bytearray(payload[:n_mask]), dtype=torch.uint8).to(base.device)
    mask = unpack_bits(packed, n)
    k = int(mask.sum())
    if len(payload) != n_mask + k * width:
        raise CorruptCheckpointError(
            f"bitmask payload has {len(payload)} bytes, expected {n_mask + k * width} "
            f"({n_mask} mask + {k} changed x {width})"
        )
    if "n_changed" in meta and int(meta["n_changed"]) != k:
        raise CorruptCheckpointError(f"bitmask marks {k} changed elements but the record says {meta['n_changed']}")
    values = tensor_from_bytes(payload[n_mask:], meta["dtype"], (k,)).to(base.device)
    out = base.detach().clone().reshape(-1)
    out[mask] = values
    return out.reshape(base.shape)


# --------------------------------------------------------------------------- helpers
def _width(dtype: torch.dtype | str) -> int:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name][1].itemsize


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Flat same-width integer view of t's bits (exact comparison, NaN- and signed-zero-safe)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(BITS_DTYPE[t.element_size()])


def _check_pair(cur: torch.Tensor, base: torch.Tensor) -> None:
    if not isinstance(cur, torch.Tensor) or not isinstance(base, torch.Tensor):
        raise ConfigError(f"cur and base must be torch.Tensors, got {type(cur).__name__} and {type(base).__name__}")
    if cur.dtype != base.dtype:
        raise ConfigError(
            f"cur dtype {cur.dtype} != base dtype {base.dtype}; cast both to the stored dtype before delta-encoding"
        )
    if tuple(cur.shape) != tuple(base.shape):
        raise ConfigError(
            f"cur shape {tuple(cur.shape)} != base shape {tuple(base.shape)}; a changed shape needs a full (keyframe) save"
        )
    if cur.device != base.device:
        raise ConfigError(f"cur is on {cur.device} but base on {base.device}; move both to one device")
    _width(cur.dtype)


def _check_meta(base: torch.Tensor, meta: dict) -> tuple[int, int]:
    """Validate that `base` is the tensor the record was encoded against; returns (numel, width)."""
    try:
        shape = tuple(int(s) for s in meta["shape"])
        dtype = str(meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"delta record metadata lacks a valid shape/dtype: {e}") from None
    if dtype not in DTYPES:
        raise CorruptCheckpointError(f"delta record names unknown dtype {dtype!r}")
    if tuple(base.shape) != shape or dtype_name(base.dtype) != dtype:
        raise ConfigError(
            f"base is {dtype_name(base.dtype)}{list(base.shape)} but the delta was encoded against "
            f"{dtype}{list(shape)}; pass the base checkpoint this delta was written against"
        )
    return base.numel(), DTYPES[dtype][1].itemsize
