"""The one bit-packer: ``n`` codes of ``bits`` bits (1, 2, 4 or 8), ``8 // bits`` per byte.

Bit order: LSB first. Code ``j`` occupies bits ``bits * (j % per) .. bits * (j % per) + bits - 1``
(bit 0 = value 1) of byte ``j // per``, ``per = 8 // bits``: the first code of a byte sits in its
lowest bits. For ``bits == 1`` this is ``numpy.packbits(x, bitorder="little")``; for ``bits == 4``,
code ``2j`` is the low nibble of byte ``j``. Padding bits of the last byte are zero, and a reader
refuses a set one. ``ceil(n / per)`` bytes in all.

Users: bitmask/1 (changed-element masks, bits = 1), cluster8/1 (labels, bits = 4) and ExCP's
codes in files written since 0.2 (bits = 4 by default). ExCP files of 0.1 packed the FIRST code in
the HIGHEST bits; :func:`unpack_msb_first` reads them and nothing writes that order any more.

Call order (torch, on the codes' device)::

    packed = pack(codes, bits)          # (ceil(n / per),) uint8 tensor
    codes = unpack(packed, n, bits)     # (n,) uint8 tensor; bytes are accepted too
"""
from __future__ import annotations

import torch

from ..errors import ConfigError, CorruptCheckpointError

WIDTHS = (1, 2, 4, 8)  # code widths that tile a byte exactly


def packed_nbytes(n: int, bits: int) -> int:
    return -(-n // (8 // _check_bits(bits)))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(n,) integer codes in [0, 2**bits) -> (ceil(n / per),) uint8, LSB first, zero padding."""
    per = 8 // _check_bits(bits)
    c = codes.detach().reshape(-1)
    if c.dtype == torch.bool:
        c = c.to(torch.uint8)
    elif c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for {bits}-bit packing")
    c = c.to(torch.uint8)
    if per == 1:
        return c.clone()
    pad = (-c.numel()) % per
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
    # the shifted codes occupy disjoint bits, so their sum is their OR and fits in a byte
    return (c.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor | bytes | bytearray | memoryview, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (n,) uint8 on packed's device. A wrong length or a set padding
    bit raises CorruptCheckpointError."""
    per = 8 // _check_bits(bits)
    b = _as_bytes_tensor(packed, n, bits)
    if per == 1:
        return b.clone()
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device)
    out = ((b.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if bool(out[n:].any()):
        raise CorruptCheckpointError(f"{bits}-bit packed codes have padding bits set; the payload is corrupt")
    return out[:n]


def unpack_msb_first(packed: bytes | bytearray | memoryview, n: int, bits: int) -> torch.Tensor:
    """Reader of ExCP's 0.1 order: the FIRST code of a byte in its HIGHEST bits. (n,) uint8."""
    per = 8 // _check_bits(bits)
    b = _as_bytes_tensor(packed, n, bits)
    shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8)
    return ((b.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n].contiguous()


def _as_bytes_tensor(packed, n: int, bits: int) -> torch.Tensor:
    if not isinstance(packed, torch.Tensor):
        packed = torch.frombuffer(bytearray(packed), dtype=torch.uint8) if len(packed) else \
            torch.zeros(0, dtype=torch.uint8)
    n_bytes = packed_nbytes(n, bits)
    if n < 0 or packed.numel() != n_bytes:
        raise CorruptCheckpointError(f"packed codes hold {packed.numel()} bytes, expected {n_bytes} for {n} "
                                     f"{bits}-bit codes")
    return packed.reshape(-1)


def _check_bits(bits: int) -> int:
    if bits not in WIDTHS:
        raise ConfigError(f"bits must be one of {WIDTHS} to pack whole bytes, got {bits!r}")
    return bits
