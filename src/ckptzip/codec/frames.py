"""Frames of the general-purpose compressors: the one place ckptzip calls zstandard and lzma.

Every reader states the most bytes it can expect; a frame that promises more (or, with
``exact``, other than that) is refused *before* anything is allocated, and every library error
becomes a ``CorruptCheckpointError`` that names what was being read. Nothing may follow a frame.

zstd frame   one standard zstd frame (RFC 8878) with its content size in the frame header, as
             ``zstandard.ZstdCompressor(level).compress`` writes it. The level only changes the
             size, never the layout. ``plane=True`` (byte planes of numbers, codec/bytegroup.py)
             narrows the level's match finder to matches of 7+ bytes in 64-entry tables: on such
             planes the entropy coder does the work and a wide match search costs time for nothing
             (exponent planes: ~2x faster than level 3 and ~8 % smaller). Levels 1-4 search with
             the single-table ``fast`` strategy there (their own is ``dfast`` from 2 up): on a small
             GPT chain's planes it found the same bytes to the kilobyte in 14-21 % less time;
             higher levels keep their own. Same frame format.
xz stream    one standard .xz stream: LZMA2 at preset 9 | EXTREME (the paper's 7-Zip "ultra" is
             LZMA2 too), CRC64 check, the dictionary shrunk to the input
             (``min(64 MiB, max(4 KiB, next power of two >= len))``: a larger one finds nothing
             more, and preset 9 would allocate ~670 MiB for it).

Call order::

    frame = zstd_compress(data, level)
    data = zstd_decompress(frame, max_bytes=len(data), what="record 'x' payload")
    blob = xz_compress(data)
    data = xz_decompress(blob, max_bytes=len(data), what="ExCP payload")
"""
from __future__ import annotations

import lzma
import threading

import zstandard

from ..configcheck import Range
from ..errors import CorruptCheckpointError

ZSTD_LEVELS = Range(ge=1, le=22)  # the levels a config may choose (the fast negative ones are not used)
_XZ_MAX_DICT = 64 << 20  # preset 9's dictionary
_local = threading.local()  # zstd contexts are not thread-safe: one set per thread


_PLANE_MATCH = {"min_match": 7, "hash_log": 6, "chain_log": 6}  # see the module docstring
_PLANE_FAST_UP_TO = 4  # plane frames of levels up to this use strategy fast (module docstring)


def _compressor(level: int, plane: bool = False) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    key = (level, plane)
    if key not in cache:
        fast = {"strategy": zstandard.STRATEGY_FAST} if level <= _PLANE_FAST_UP_TO else {}
        cache[key] = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
            level, **_PLANE_MATCH, **fast)) if plane else zstandard.ZstdCompressor(level=level)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def zstd_compress(data: bytes | bytearray | memoryview, level: int = 3, *, plane: bool = False) -> bytes:
    """One zstd frame of ``data`` at ``level`` (content size in its header); ``plane``: tuned for a
    byte plane of numbers (module docstring)."""
    return _compressor(level, plane).compress(data)


def zstd_content_size(frame: bytes | memoryview, *, what: str) -> int:
    """The content size a frame header promises (-1: not recorded)."""
    try:
        return zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"{what} is not a zstd frame ({e})") from None


def zstd_decompress(frame: bytes | memoryview, *, max_bytes: int, what: str, exact: bool = False) -> bytes:
    """Inverse of :func:`zstd_compress`: at most ``max_bytes`` bytes (exactly, with ``exact``)."""
    size = zstd_content_size(frame, what=what)
    if size > max_bytes or (exact and size not in (-1, max_bytes)):
        raise CorruptCheckpointError(f"{what} promises {size} bytes, {'expected' if exact else 'at most'} "
                                     f"{max_bytes}")
    try:
        out = _decompressor().decompress(frame, max_output_size=max_bytes, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"{what} does not decompress: {e}") from None
    if exact and len(out) != max_bytes:
        raise CorruptCheckpointError(f"{what} holds {len(out)} bytes, expected {max_bytes}")
    return out


def xz_compress(data: bytes | bytearray | memoryview) -> bytes:
    """One .xz stream of ``data`` (LZMA2 preset 9 | EXTREME, CRC64, dictionary fitted to the input)."""
    dict_size = min(_XZ_MAX_DICT, max(4096, 1 << max(0, len(data) - 1).bit_length()))
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": dict_size}]
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)


def xz_decompress(blob: bytes | memoryview, *, max_bytes: int | None, what: str = "LZMA stream") -> bytes:
    """Inverse of :func:`xz_compress`: exactly one stream, nothing after it, at most ``max_bytes``."""
    d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        out = d.decompress(blob, max_length=-1 if max_bytes is None else max_bytes + 1)
    except lzma.LZMAError as e:
        raise CorruptCheckpointError(f"{what} is damaged ({e})") from None
    if max_bytes is not None and len(out) > max_bytes:
        raise CorruptCheckpointError(f"{what} expands beyond max_bytes={max_bytes}")
    if not d.eof:
        raise CorruptCheckpointError(f"{what} is truncated")
    if d.unused_data:
        raise CorruptCheckpointError(f"{what} is followed by {len(d.unused_data)} stray bytes")
    return out
