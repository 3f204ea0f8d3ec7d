"""The BitSnap paper's baselines that bench/bitsnap.py compares with; not part of the library.

- COO deltas (paper Fig. 9): the int32 flat indices of the changed elements, then their values.
  ``codec/bitmask.encoded_sizes`` gives its byte count, ``k * (4 + w)``, beside the bitmask's.
- naive uint8 (paper Tables 3-4): one asymmetric min-max uint8 grid over the whole tensor, which
  is exactly cluster8 with a single cluster.

Import from a bench script or test: ``sys.path.insert(0, <repo>/bench); import paper_baselines``.
"""
from __future__ import annotations

import torch

from ckptzip.codec import bitmask
from ckptzip.errors import ConfigError, CorruptCheckpointError
from ckptzip.quant import cluster8
from ckptzip.quant.base import QuantizedTensor
from ckptzip.tensorbytes import dtype_name, tensor_from_bytes, tensor_to_bytes

COO_INDEX_BYTES = 4  # int32 little-endian element index


def coo_encode(cur: torch.Tensor, base: torch.Tensor) -> tuple[bytes, dict]:
    """Sparse-matrix baseline: int32 flat indices of the changed elements, then their values."""
    n = cur.numel()
    if n > 2**31 - 1:
        raise ConfigError(f"COO with int32 indices holds at most 2**31-1 elements, got {n}; split the tensor")
    mask = bitmask.changed_mask(cur, base)  # checks dtype, shape and device
    idx = torch.nonzero(mask).reshape(-1).to(torch.int32)
    values = cur.detach().reshape(-1)[mask]
    meta = {"shape": list(cur.shape), "dtype": dtype_name(cur.dtype), "n_changed": int(idx.numel())}
    return tensor_to_bytes(idx) + tensor_to_bytes(values), meta


def coo_decode(payload: bytes, base: torch.Tensor, meta: dict) -> torch.Tensor:
    """Inverse of coo_encode (bit-exact), on base's device."""
    if list(base.shape) != list(meta.get("shape", [])) or dtype_name(base.dtype) != meta.get("dtype"):
        raise ConfigError(f"base is {dtype_name(base.dtype)}{list(base.shape)}, the COO delta was taken against "
                          f"{meta.get('dtype')}{meta.get('shape')}")
    n, width, k = base.numel(), base.element_size(), int(meta.get("n_changed", -1))
    if k < 0 or len(payload) != k * (COO_INDEX_BYTES + width):
        raise CorruptCheckpointError(f"COO payload has {len(payload)} bytes, expected n_changed x "
                                     f"{COO_INDEX_BYTES + width} (n_changed={k})")
    idx = tensor_from_bytes(payload[: k * COO_INDEX_BYTES], "int32", (k,)).long()
    if k and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise CorruptCheckpointError(f"COO index out of range [0, {n})")
    values = tensor_from_bytes(payload[k * COO_INDEX_BYTES:], meta["dtype"], (k,))
    out = base.detach().clone().reshape(-1)
    out[idx.to(base.device)] = values.to(base.device)
    return out.reshape(base.shape)


def naive_uint8_quantize(x: torch.Tensor) -> QuantizedTensor:
    """The paper's naive 8-bit baseline: one asymmetric min-max uint8 grid (cluster8, K = 1)."""
    return cluster8.quantize(x, cluster8.Cluster8Config(n_clusters=1))


def naive_uint8_dequantize(q: QuantizedTensor) -> torch.Tensor:
    return cluster8.dequantize(q)
