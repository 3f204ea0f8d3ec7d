"""Entropy coders for integer streams, and the full DynaQuant code pipeline (§6).

Base of the coder family. A coder turns a flat stream of int64 symbols into self-describing bytes
and back; every coder here has the same two calls::

    buf = encode(symbols)          # symbols: 1-D numpy array or torch tensor of integers
    symbols = decode(buf)          # -> 1-D numpy int64 array, exactly the input

Registered coders (``CODERS``; the name is what ``encode_codes`` records):

- ``"huffman"``  canonical length-limited Huffman, numba fast path (codec/huffman.py)
- ``"ans"``      ANS with the empirical frequencies, via constriction (codec/ans.py)
- ``"rans"``     interleaved static rANS with the empirical frequencies, numba kernels (codec/rans.py)
- ``"zstd"``     zstandard on the raw little-endian integers in the narrowest width that holds
                 them (a baseline for comparison)

Every coder buffer is framed the same way: a 3-byte magic (two letters + format version), the
coder's fields as LEB128 varints, its payload, then a CRC-32 (little-endian) of everything before
it. A decoder checks the CRC first, so any truncation or flipped bit raises
``CorruptCheckpointError`` before a table is built or memory is sized from a header field.

The code pipeline (quantization-aware delta, Inshrinkerator §6)::

    buf  = encode_codes(prev_codes, cur_codes, n_levels, rearrange=True, rle=True, coder="huffman")
    cur  = decode_codes(buf, prev_codes)            # prev_codes=None for a keyframe

    keyframe (prev is None):   codes --------------------------------> [RLE] -> coder
    delta:                     D = (prev - cur) mod B -> [rearrange] -> [RLE] -> coder

``encode_codes`` buffer, byte by byte::

    b"CQ" 0x01            magic + version
    flags (u8)            bit 0 delta, bit 1 rearranged, bit 2 RLE, bits 4-7 coder id
                          (0 huffman, 1 ans, 2 zstd, 3 rans)
    n (varint)            number of codes
    n_levels (varint)     B of the cyclic delta (codes lie in [0, B))
    crc32 (u32 LE)        of the bytes above
    coder buffer          the rest: the coder's own framed bytes (with its own CRC)

The reader needs nothing but ``prev_codes`` (for a delta). The runs of the RLE stage cross the
group boundaries of the rearrangement: never longer than per-group runs, decoded identically.
"""
from __future__ import annotations

import importlib
import struct
import zlib
from typing import Callable

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from . import delta as _delta
from . import rle as _rle
from .frames import zstd_compress, zstd_decompress

__all__ = [
    "CODERS", "get_coder", "encode_stream", "decode_stream", "zstd_encode", "zstd_decode",
    "encode_codes", "decode_codes", "read_codes_header", "entropy_bits",
    "as_symbols", "symbol_table", "symbol_counts", "ByteReader", "write_varint", "pack_varints", "seal", "unseal",
    "pack_alphabet", "read_alphabet", "alphabet_header", "open_alphabet_stream", "single_value_stream",
]

# name -> (module, encode function, decode function); resolved on first use so that the coder
# modules can import the framing helpers below without an import cycle
CODERS: dict[str, tuple[str, str, str]] = {
    "huffman": ("ckptzip.codec.huffman", "huffman_encode", "huffman_decode"),
    "ans": ("ckptzip.codec.ans", "ans_encode", "ans_decode"),
    "zstd": ("ckptzip.codec.entropy", "zstd_encode", "zstd_decode"),
    "rans": ("ckptzip.codec.rans", "rans_encode", "rans_decode"),
}
_CODER_IDS = {"huffman": 0, "ans": 1, "zstd": 2, "rans": 3}   # stored in the codes header; never renumber
_CODER_NAMES = {v: k for k, v in _CODER_IDS.items()}

_CODES_MAGIC = b"CQ\x01"
_F_DELTA, _F_REARRANGE, _F_RLE = 1, 2, 4
_ZSTD_MAGIC = b"ZS\x01"
_ZSTD_WIDTHS = {1: np.dtype("i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


# =========================================================================== registry
def get_coder(name: str) -> tuple[Callable, Callable]:
    """(encode, decode) of a registered coder."""
    try:
        module, enc, dec = CODERS[name]
    except KeyError:
        raise ValueError(f"unknown coder {name!r}; choose one of {sorted(CODERS)}") from None
    mod = importlib.import_module(module)
    return getattr(mod, enc), getattr(mod, dec)


def encode_stream(name: str, symbols) -> bytes:
    """Encode a 1-D integer stream with the named coder."""
    return get_coder(name)[0](symbols)


def decode_stream(name: str, buf: bytes) -> np.ndarray:
    """Decode bytes written by ``encode_stream(name, ...)`` -> 1-D int64 numpy array."""
    return get_coder(name)[1](buf)


# =========================================================================== zstd baseline
def zstd_encode(symbols, level: int = 3) -> bytes:
    """zstandard on the raw integers, stored in the narrowest signed width that holds them."""
    sym = as_symbols(symbols)
    width = 8
    if sym.size:
        lo, hi = int(sym.min()), int(sym.max())
        width = next(w for w in (1, 2, 4, 8) if -(1 << (8 * w - 1)) <= lo and hi < (1 << (8 * w - 1)))
    out = bytearray(_ZSTD_MAGIC)
    out.append(width)
    write_varint(out, sym.size)
    out += zstd_compress(sym.astype(_ZSTD_WIDTHS[width]).tobytes(), level)
    return seal(out)


def zstd_decode(buf) -> np.ndarray:
    """Inverse of :func:`zstd_encode`."""
    r = ByteReader(unseal(buf, "zstd stream"), "zstd stream")
    r.magic(_ZSTD_MAGIC)
    width = r.u8()
    if width not in _ZSTD_WIDTHS:
        raise CorruptCheckpointError(f"zstd stream has integer width {width}, expected 1, 2, 4 or 8")
    n = r.varint()
    raw = zstd_decompress(r.rest(), max_bytes=n * width, exact=True, what="zstd stream")
    return np.frombuffer(raw, dtype=_ZSTD_WIDTHS[width]).astype(np.int64)


# =========================================================================== code pipeline
def encode_codes(prev_codes: torch.Tensor | None, cur_codes: torch.Tensor, n_levels: int, *,
                 rearrange: bool = True, rle: bool = True, coder: str = "huffman") -> bytes:
    """Encode the integer codes of one tensor, against the previous checkpoint's codes if given.

    ``n_levels``: B, the cyclic buffer size; pass max(levels of prev, levels of cur). Codes may
    live on any device; the delta, rearrangement and RLE run there, the entropy coder on CPU.
    ``rearrange`` is ignored for a keyframe (there is no source bucket to group by).
    """
    if coder not in _CODER_IDS:
        raise ValueError(f"unknown coder {coder!r}; choose one of {sorted(_CODER_IDS)}")
    if not isinstance(cur_codes, torch.Tensor):
        raise TypeError(f"cur_codes must be a torch.Tensor, got {type(cur_codes).__name__}")
    cur = cur_codes.reshape(-1)
    if prev_codes is None:
        _delta._check_levels(n_levels)
        cur = _delta._flat_codes(cur, "cur_codes")
        _delta._check_range(cur, n_levels, "cur_codes")
        stream, flags = cur, 0
    else:
        prev = prev_codes.reshape(-1).to(cur.device)
        if rearrange:
            stream, _ = _delta.grouped_cyclic_delta(prev, cur, n_levels)
            flags = _F_DELTA | _F_REARRANGE
        else:
            stream = _delta.cyclic_delta(prev, cur, n_levels)
            flags = _F_DELTA
    if rle:
        stream = _rle.rle_encode(stream)
        flags |= _F_RLE
    flags |= _CODER_IDS[coder] << 4
    head = bytearray(_CODES_MAGIC)
    head.append(flags)
    write_varint(head, cur.numel())
    write_varint(head, int(n_levels))
    return bytes(seal(head)) + encode_stream(coder, stream)


def read_codes_header(buf) -> dict:
    """The header fields of an ``encode_codes`` buffer (without decoding the stream)."""
    h, _ = _split_codes(buf)
    return h


def decode_codes(buf, prev_codes: torch.Tensor | None = None, n_levels: int | None = None, *,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_codes` -> (n,) int64 codes.

    ``prev_codes``: the previous checkpoint's codes, required exactly when the buffer is a delta.
    ``n_levels``: optional check against the recorded B. The result lives on ``device``, else on
    ``prev_codes``'s device, else on CPU.
    """
    h, body = _split_codes(buf)
    n, levels = h["n"], h["n_levels"]
    if n_levels is not None and int(n_levels) != levels:
        raise ValueError(f"the buffer was encoded with n_levels={levels}, caller expects {n_levels}")
    if h["delta"] and prev_codes is None:
        raise ValueError("this buffer is a delta: pass the previous checkpoint's codes as prev_codes")
    if device is None:
        device = prev_codes.device if prev_codes is not None else "cpu"
    symbols = decode_stream(h["coder"], body)
    stream = torch.from_numpy(symbols).to(device)
    if h["rle"]:
        stream = _rle.rle_decode(stream, n)
    elif stream.numel() != n:
        raise CorruptCheckpointError(f"code stream holds {stream.numel()} symbols, header says {n}")
    lo, hi = (int(v) for v in torch.aminmax(stream)) if n else (0, 0)
    if lo < 0 or hi >= levels:
        raise CorruptCheckpointError(f"decoded codes fall outside [0, {levels})")
    if not h["delta"]:
        return stream
    prev = _delta._flat_codes(prev_codes, "prev_codes").to(device)
    if prev.numel() != n:
        raise ValueError(f"prev_codes has {prev.numel()} codes but the delta was taken over {n}; "
                         "pass the codes of the checkpoint this delta was encoded against")
    if h["rearrange"]:  # range-checks prev while counting its groups
        return _delta.undo_grouped_cyclic_delta(prev, stream, levels).to(torch.int64)
    _delta._check_range(prev, levels, "prev_codes")
    return _delta.undo_cyclic_delta(prev, stream, levels).to(torch.int64)


def _split_codes(buf) -> tuple[dict, memoryview]:
    mv = memoryview(buf).cast("B")
    r = ByteReader(mv, "code buffer")
    r.magic(_CODES_MAGIC)
    flags = r.u8()
    n = r.varint()
    levels = r.varint()
    end = r.pos
    (crc,) = struct.unpack("<I", bytes(r.take(4)))
    if zlib.crc32(mv[:end]) != crc:
        raise CorruptCheckpointError("code buffer header fails its CRC-32")
    coder_id = flags >> 4
    if coder_id not in _CODER_NAMES or flags & 8 or levels < 1:
        raise CorruptCheckpointError(f"code buffer header has invalid flags {flags:#x} or n_levels {levels}")
    return ({"n": n, "n_levels": levels, "delta": bool(flags & _F_DELTA),
             "rearrange": bool(flags & _F_REARRANGE), "rle": bool(flags & _F_RLE),
             "coder": _CODER_NAMES[coder_id]}, r.rest())


# =========================================================================== estimates
def entropy_bits(symbols) -> float:
    """Order-0 entropy of a stream in bits (n * H(p) of its empirical distribution); torch."""
    t = symbols if isinstance(symbols, torch.Tensor) else torch.as_tensor(np.asarray(symbols))
    t = t.reshape(-1)
    if t.numel() == 0:
        return 0.0
    lo, hi = (int(v) for v in torch.aminmax(t))
    if hi - lo < max(1 << 22, 2 * t.numel()):
        counts = torch.bincount((t.to(torch.int64) - lo))
    else:  # sparse alphabet: a sort is cheaper than a huge count table
        counts = torch.unique(t, return_counts=True)[1]
    counts = counts[counts > 0].to(torch.float64)
    n = float(t.numel())
    return float(-(counts * torch.log2(counts / n)).sum())


# =========================================================================== framing helpers
def as_symbols(symbols) -> np.ndarray:
    """Any 1-D integer array-like (numpy, torch on any device, list) -> contiguous int64 numpy."""
    if isinstance(symbols, torch.Tensor):
        if symbols.dtype.is_floating_point or symbols.dtype.is_complex or symbols.dtype == torch.bool:
            raise TypeError(f"symbols must be integers, got {symbols.dtype}")
        symbols = symbols.detach().reshape(-1).to("cpu", torch.int64).numpy()
    a = np.asarray(symbols)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise TypeError(f"symbols must be integers, got dtype {a.dtype}")
    if a.dtype == np.uint64 and a.size and int(a.max()) >= 1 << 63:
        raise ValueError("symbols must fit in int64")
    return np.ascontiguousarray(a.reshape(-1), dtype=np.int64)


def write_varint(out: bytearray, value: int) -> None:
    """Append one unsigned LEB128 varint (7 bits a byte, high bit = more bytes follow)."""
    if value < 0:
        raise ValueError(f"varint must be >= 0, got {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def pack_varints(values: np.ndarray) -> bytes:
    """Many unsigned LEB128 varints at once (vectorized; a plain loop for short lists, where the
    vectorized form's ~10 passes cost ~100 us per call)."""
    a = np.asarray(values, dtype=np.uint64).reshape(-1)
    if a.size == 0:
        return b""
    if a.size <= 256:
        out = bytearray()
        for v in a.tolist():
            write_varint(out, v)
        return bytes(out)
    nbytes = np.ones(a.size, dtype=np.int64)
    for j in range(1, 10):
        nbytes += (a >> np.uint64(7 * j)) != 0
    starts = np.cumsum(nbytes) - nbytes
    out = np.empty(int(nbytes.sum()), dtype=np.uint8)
    for j in range(10):
        m = nbytes > j
        if not m.any():
            break
        byte = ((a[m] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= np.where(nbytes[m] > j + 1, 0x80, 0).astype(np.uint8)
        out[starts[m] + j] = byte
    return out.tobytes()


def seal(body: bytes | bytearray) -> bytes:
    """body || CRC-32(body) as u32 little-endian."""
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def unseal(buf, what: str) -> memoryview:
    """Check and strip the CRC-32 trailer written by :func:`seal`."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
    if len(mv) < 4:
        raise CorruptCheckpointError(f"{what} is truncated ({len(mv)} bytes)")
    (crc,) = struct.unpack("<I", mv[-4:])
    if zlib.crc32(mv[:-4]) != crc:
        raise CorruptCheckpointError(f"{what} fails its CRC-32 (corrupt or truncated)")
    return mv[:-4]


class ByteReader:
    """Bounds-checked cursor over bytes; every overrun raises CorruptCheckpointError."""

    def __init__(self, buf, what: str):
        self.mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) or buf.format != "B" else buf
        self.pos = 0
        self.what = what

    def take(self, k: int) -> memoryview:
        if k < 0 or self.pos + k > len(self.mv):
            raise CorruptCheckpointError(f"{self.what} is truncated (wanted {k} bytes at offset {self.pos})")
        out = self.mv[self.pos:self.pos + k]
        self.pos += k
        return out

    def magic(self, expected: bytes) -> None:
        got = bytes(self.take(len(expected))) if len(self.mv) >= len(expected) else bytes(self.mv)
        if got != expected:
            raise CorruptCheckpointError(f"{self.what} starts with {got!r}, expected {expected!r} "
                                         "(not this format, or a newer version)")

    def u8(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value = shift = 0
        for _ in range(10):
            b = self.u8()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                if value >= 1 << 64:
                    break
                return value
            shift += 7
        raise CorruptCheckpointError(f"{self.what} holds a malformed varint at offset {self.pos}")

    def varints(self, count: int) -> np.ndarray:
        """``count`` varints -> uint64 array (vectorized; a plain loop for short lists, as in
        ``pack_varints``: a code stream's alphabet and counts are a few values each)."""
        if count == 0:
            return np.zeros(0, dtype=np.uint64)
        if count <= 16:
            return np.array([self.varint() for _ in range(count)], dtype=np.uint64)
        window = np.frombuffer(self.mv[self.pos:self.pos + 10 * count], dtype=np.uint8)
        ends = np.flatnonzero(window < 0x80)
        if ends.size < count:
            raise CorruptCheckpointError(f"{self.what} is truncated inside a list of {count} varints")
        ends = ends[:count]
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1
        if int(lengths.max()) > 10:
            raise CorruptCheckpointError(f"{self.what} holds a varint longer than 10 bytes")
        seg = window[:ends[-1] + 1]
        shift = (np.arange(seg.size) - np.repeat(starts, lengths)) * 7
        parts = (seg & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
        self.pos += seg.size
        return np.add.reduceat(parts, starts)

    def rest(self) -> memoryview:
        out = self.mv[self.pos:]
        self.pos = len(self.mv)
        return out

    def expect_end(self) -> None:
        if self.pos != len(self.mv):
            raise CorruptCheckpointError(f"{self.what} has {len(self.mv) - self.pos} trailing bytes")


def zigzag(v: int) -> int:
    """Signed -> unsigned (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...)."""
    return (v << 1) if v >= 0 else ((-v) << 1) - 1


def unzigzag(u: int) -> int:
    return (u >> 1) if not u & 1 else -((u + 1) >> 1)


def pack_alphabet(values: np.ndarray) -> bytes:
    """Sorted distinct int64 values: zigzag varint of the first, then varints of gap - 1."""
    if values.size == 0:
        return b""
    head = bytearray()
    write_varint(head, zigzag(int(values[0])))
    gaps = (np.diff(values).astype(np.uint64) - np.uint64(1)) if values.size > 1 else np.zeros(0, np.uint64)
    return bytes(head) + pack_varints(gaps)


def alphabet_header(magic: bytes, n: int, values: np.ndarray) -> bytearray:
    """Start of the symbol coders' streams (huffman, ans): magic, n, k = len(values), the alphabet."""
    out = bytearray(magic)
    write_varint(out, n)
    write_varint(out, values.size)
    out += pack_alphabet(values)
    return out


def open_alphabet_stream(buf, magic: bytes, what: str, *, max_k: int | None = None
                         ) -> tuple["ByteReader", int, np.ndarray]:
    """Inverse of :func:`alphabet_header` on a sealed stream: (reader after the alphabet, n, values)."""
    r = ByteReader(unseal(buf, what), what)
    r.magic(magic)
    n = r.varint()
    k = r.varint()
    if (n == 0) != (k == 0) or k > n or (max_k is not None and k > max_k):
        raise CorruptCheckpointError(f"{what} header is inconsistent (n={n}, k={k})")
    return r, n, read_alphabet(r, k)


def single_value_stream(r: ByteReader, n: int, values: np.ndarray) -> np.ndarray | None:
    """A stream of at most one distinct value has no payload: its n symbols (None when k >= 2)."""
    if values.size > 1:
        return None
    r.expect_end()
    return np.full(n, values[0] if values.size else 0, dtype=np.int64)


def read_alphabet(r: ByteReader, k: int) -> np.ndarray:
    """Inverse of :func:`pack_alphabet`: k strictly increasing int64 values."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    first = unzigzag(r.varint())
    gaps = r.varints(k - 1)
    if not -(1 << 63) <= first < 1 << 63 or (gaps.size and int(gaps.max()) >= 1 << 63):
        raise CorruptCheckpointError(f"{r.what} alphabet overflows int64")
    steps = np.cumsum(gaps + np.uint64(1), dtype=np.uint64)   # offsets from the first value
    # every step adds >= 1, so a wrap of the uint64 cumsum shows up as a decrease
    if steps.size and (int(steps[-1]) + first >= 1 << 63 or bool((np.diff(steps) == 0).any())
                       or bool((steps[1:] < steps[:-1]).any())):
        raise CorruptCheckpointError(f"{r.what} alphabet overflows int64")
    out = np.empty(k, dtype=np.int64)
    out[0] = first
    # two's-complement add: exact because every result lies in int64 (checked above)
    out[1:] = (np.uint64(first % (1 << 64)) + steps).view(np.int64)
    return out


def symbol_table(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, counts, index) of an int64 stream: sorted distinct values, how often each occurs,
    and each symbol's position in ``values`` (int32). Counting table when the value span is
    small (the usual case; fused numba passes when available), a sort otherwise."""
    values, counts, lo, lut = symbol_counts(sym)
    if lut is None:
        return values, counts, np.unique(sym, return_inverse=True)[1].astype(np.int32).reshape(-1)
    if _numba is not None:
        index = np.empty(sym.size, dtype=np.int32)
        _index_kernel(sym, lo, lut, index)
        return values, counts, index
    return values, counts, lut[sym - np.int64(lo)]


def symbol_counts(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
    """(values, counts, lo, lut) of an int64 stream, without the index pass of :func:`symbol_table`:
    ``lut[v - lo]`` is value v's position in ``values`` (int32) when the value span is small enough
    for a counting table, else None."""
    if sym.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, 0, np.zeros(0, dtype=np.int32)
    if _numba is not None:
        lo, hi = (int(v) for v in _minmax_kernel(sym))
    else:
        lo, hi = int(sym.min()), int(sym.max())
    if hi - lo >= max(1 << 22, 2 * sym.size):
        values, counts = np.unique(sym, return_counts=True)
        return values.astype(np.int64), counts.astype(np.int64), lo, None
    if _numba is not None:
        cnt = np.zeros(hi - lo + 1, dtype=np.int64)
        _count_kernel(sym, lo, cnt)
    else:
        cnt = np.bincount(sym - np.int64(lo), minlength=hi - lo + 1)
    present = np.flatnonzero(cnt)
    lut = np.zeros(cnt.size, dtype=np.int32)
    lut[present] = np.arange(present.size, dtype=np.int32)
    return present.astype(np.int64) + np.int64(lo), cnt[present].astype(np.int64), lo, lut


try:  # optional fused passes for symbol_table
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

if _numba is not None:
    @_numba.njit(cache=True, nogil=True)
    def _minmax_kernel(sym):  # pragma: no cover - compiled
        lo = sym[0]
        hi = sym[0]
        for v in sym:  # min/max, not branches: the loop vectorizes (2x faster)
            lo = min(lo, v)
            hi = max(hi, v)
        return lo, hi

    @_numba.njit(cache=True, nogil=True)
    def _count_kernel(sym, lo, cnt):  # pragma: no cover - compiled
        k = cnt.size
        if k > 4096:
            for v in sym:
                cnt[v - lo] += 1
            return
        # small alphabets: four interleaved tables. A skewed stream increments one counter over and
        # over, and each increment waits for the previous one's store; four chains run in parallel
        c = np.zeros((4, k), dtype=np.int64)
        n4 = sym.size - sym.size % 4
        for i in range(0, n4, 4):
            c[0, sym[i] - lo] += 1
            c[1, sym[i + 1] - lo] += 1
            c[2, sym[i + 2] - lo] += 1
            c[3, sym[i + 3] - lo] += 1
        for i in range(n4, sym.size):
            c[0, sym[i] - lo] += 1
        for j in range(k):
            cnt[j] += c[0, j] + c[1, j] + c[2, j] + c[3, j]

    @_numba.njit(cache=True, nogil=True)
    def _index_kernel(sym, lo, lut, out):  # pragma: no cover - compiled
        for i in range(sym.shape[0]):
            out[i] = lut[sym[i] - lo]
