"""Byte-grouped floats + zstd (the ZipNN idea), lossless.

Floats compress badly as interleaved bytes because the exponent byte (low entropy) sits between
mantissa bytes (near-random). We rotate each word left by one bit, so that the sign lands in the
lowest bit and the exponent fills the top byte, then split the words into byte planes (all top
bytes, then all next bytes, ...) and compress each plane as its own zstd frame: the exponent plane
shrinks a lot, the mantissa planes hardly at all. Integers are only byte-grouped.

Blob layout: ``u8 width | u8 flags(bit0: rotated) | u64 n_words | u32 plane_len[width] | planes``
(little-endian; planes most-significant byte first). A plane that zstd cannot shrink is stored raw
(its length has bit 31 set).
"""
from __future__ import annotations

import struct

import numpy as np

from ..errors import CorruptCheckpointError
from .frames import zstd_compress, zstd_decompress

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_RAW = 1 << 31


def _rotl1(words: np.ndarray, bits: int) -> np.ndarray:
    return (words << 1) | (words >> (bits - 1))


def _rotr1(words: np.ndarray, bits: int) -> np.ndarray:
    return (words >> 1) | (words << (bits - 1))


def compress(raw: bytes | memoryview, width: int, *, float_bits: bool = True, level: int = 3) -> bytes:
    if width not in _UINT or len(raw) % width:
        raise ValueError(f"byte grouping needs a width in {sorted(_UINT)} dividing the data, got {width}")
    words = np.frombuffer(raw, dtype=np.dtype(_UINT[width]).newbyteorder("<"))
    rotate = bool(float_bits and width > 1)
    if rotate:
        words = _rotl1(words.astype(_UINT[width], copy=False), 8 * width)
    planes = words.view(np.uint8).reshape(-1, width)[:, ::-1].T  # (width, n): MSB plane first
    lens, out = [], []
    for p in planes:
        p = np.ascontiguousarray(p).tobytes()
        c = zstd_compress(p, level)
        if len(c) >= len(p):
            lens.append(len(p) | _RAW)
            out.append(p)
        else:
            lens.append(len(c))
            out.append(c)
    head = struct.pack(f"<BBQ{width}I", width, int(rotate), len(words), *lens)
    return head + b"".join(out)


def decompress(blob: bytes | memoryview) -> bytes:
    blob = memoryview(blob)
    try:
        width, flags, n = struct.unpack_from("<BBQ", blob, 0)
        if width not in _UINT or flags & ~1 or (flags and width == 1):  # compress never writes these
            raise ValueError
        lens = struct.unpack_from(f"<{width}I", blob, 10)
    except (struct.error, ValueError):
        raise CorruptCheckpointError("byte-grouped blob has a malformed header") from None
    off = 10 + 4 * width
    end = off + sum(ln & ~_RAW for ln in lens)
    if end != len(blob):
        raise CorruptCheckpointError("byte-grouped blob has trailing bytes" if end < len(blob) else
                                     f"byte-grouped blob is truncated: {len(blob)} bytes, its planes need {end}")
    for i, ln in enumerate(lens):
        size = ln & ~_RAW
        chunk = blob[off:off + size]
        off += size
        # the size a plane promises is checked before allocating: a corrupt word count or frame
        # header must not ask for terabytes (MemoryError is not a typed error)
        if ln & _RAW:
            if size != n:
                raise CorruptCheckpointError(f"byte plane {i} holds {size} bytes, expected {n}")
            p = bytes(chunk)
        else:
            p = zstd_decompress(chunk, max_bytes=n, exact=True, what=f"byte plane {i}")
        if i == 0:
            planes = np.empty((width, n), dtype=np.uint8)
        planes[i] = np.frombuffer(p, dtype=np.uint8)
    words = np.ascontiguousarray(planes[::-1].T).view(_UINT[width]).reshape(-1)
    if flags & 1:
        words = _rotr1(words, 8 * width)
    return words.astype(np.dtype(_UINT[width]).newbyteorder("<"), copy=False).tobytes()
