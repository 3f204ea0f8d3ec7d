"""The byte framing every integer-stream coder shares (huffman, ans, rans, zstd in codec/entropy.py).

A coder buffer: a 3-byte magic (two letters + format version), the coder's fields as unsigned
LEB128 varints, its payload, then a CRC-32 (u32 little-endian) of everything before it. A decoder
checks the CRC first (:func:`unseal`), so any truncation or flipped bit raises
``CorruptCheckpointError`` before a table is built or memory is sized from a header field; every
read after that goes through the bounds-checked :class:`ByteReader`.

The symbol coders' streams start with the same alphabet header::

    magic | n (varint) | k = distinct values (varint) | first value (zigzag varint) | k-1 gaps - 1 (varints)

    out = alphabet_header(b"XY\x01", n, values); out += payload; buf = seal(out)
    r, n, values = open_alphabet_stream(buf, b"XY\x01", "what")   # then the coder reads its payload from r
"""
from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..tensorbytes import INT_DTYPES, numpy_dtype

# integer dtypes the numba kernels read as they are (each op widens to int64 first): a code stream of
# 124M uint8 codes widened to int64 was 1 GB of fresh pages per save, a page fault per 4 KiB
NARROW = tuple(numpy_dtype(d).type for d in INT_DTYPES)


def as_symbols(symbols, *, narrow: bool = False) -> np.ndarray:
    """Any 1-D integer array-like (numpy, torch on any device, list) -> contiguous int64 numpy.
    ``narrow``: keep a dtype in NARROW as it is (for kernels that widen each value themselves)."""
    if isinstance(symbols, torch.Tensor):
        if symbols.dtype.is_floating_point or symbols.dtype.is_complex or symbols.dtype == torch.bool:
            raise TypeError(f"symbols must be integers, got {symbols.dtype}")
        t = symbols.detach().reshape(-1).cpu()
        symbols = t.numpy() if narrow and t.dtype in INT_DTYPES else t.to(torch.int64).numpy()
    a = np.asarray(symbols)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise TypeError(f"symbols must be integers, got dtype {a.dtype}")
    if a.dtype == np.uint64 and a.size and int(a.max()) >= 1 << 63:
        raise ValueError("symbols must fit in int64")
    keep = narrow and a.dtype.type in NARROW
    return np.ascontiguousarray(a.reshape(-1), dtype=a.dtype if keep else np.int64)


def write_varint(out: bytearray, value: int) -> None:
    """Append one unsigned LEB128 varint (7 bits a byte, high bit = more bytes follow)."""
    if value < 0:
        raise ValueError(f"varint must be >= 0, got {value}")
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def pack_varints(values: np.ndarray) -> bytes:
    """Many unsigned LEB128 varints at once: a numba pass, else vectorized numpy (a plain loop for
    short lists, where the vectorized form's ~10 passes cost ~100 us per call)."""
    a = np.asarray(values, dtype=np.uint64).reshape(-1)
    if a.size == 0:
        return b""
    if _numba is not None and a.size > 4:  # an RLE stream's alphabet: hundreds of gaps, 0.3 us each in the loop
        out = np.empty(10 * a.size, dtype=np.uint8)
        return out[:_pack_varints_kernel(a, out)].tobytes()
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
        mv, pos = self.mv, self.pos  # the bytes read in place: a record's header holds dozens
        value = shift = 0
        for i in range(pos, min(pos + 10, len(mv))):
            b = mv[i]
            value |= (b & 0x7F) << shift
            if b < 0x80:
                if value >= 1 << 64:
                    break
                self.pos = i + 1
                return value
            shift += 7
        else:
            if len(mv) - pos < 10:
                raise CorruptCheckpointError(f"{self.what} is truncated (wanted 1 bytes at offset {len(mv)})")
        raise CorruptCheckpointError(f"{self.what} holds a malformed varint at offset {self.pos}")

    def varints(self, count: int) -> np.ndarray:
        """``count`` varints -> uint64 array (one numba pass; without numba, vectorized numpy, or a
        plain loop for short lists, as in ``pack_varints``)."""
        if count == 0:
            return np.zeros(0, dtype=np.uint64)
        if count > len(self.mv) - self.pos:  # a varint takes a byte at least: refused before allocating
            raise CorruptCheckpointError(f"{self.what} is truncated inside a list of {count} varints")
        if _numba is not None:
            out = np.empty(count, dtype=np.uint64)
            end = _varints_kernel(np.frombuffer(self.mv, dtype=np.uint8), self.pos, out)
            if end == -1:
                raise CorruptCheckpointError(f"{self.what} is truncated inside a list of {count} varints")
            if end < 0:
                raise CorruptCheckpointError(f"{self.what} holds a malformed varint in a list of {count}")
            self.pos = end
            return out
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
    if _numba is not None and -(1 << 63) <= first < 1 << 63:
        out = np.empty(k, dtype=np.int64)
        if not _alphabet_kernel(first, gaps, out):
            raise CorruptCheckpointError(f"{r.what} alphabet overflows int64")
        return out
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
        # small alphabets: eight interleaved tables. A skewed stream increments one counter over and
        # over, and each increment waits for the previous one's store; eight chains run in parallel
        # (0.45 -> 0.33 ns a symbol against four, on delta codes 87 % one value)
        c = np.zeros((8, k), dtype=np.int64)
        n8 = np.uint64(sym.size - sym.size % 8)
        for i in range(np.uint64(0), n8, np.uint64(8)):  # unsigned: no wraparound test per access
            for j in range(8):
                c[j, sym[i + np.uint64(j)] - lo] += 1
        for i in range(n8, np.uint64(sym.size)):
            c[0, sym[i] - lo] += 1
        for j in range(k):
            cnt[j] += c[0, j] + c[1, j] + c[2, j] + c[3, j] + c[4, j] + c[5, j] + c[6, j] + c[7, j]

    @_numba.njit(inline="always")
    def _put_varint(out, pos, v):  # pragma: no cover - compiled
        """write_varint of v (>= 0) into out at pos -> the position after it."""
        u = np.uint64(v)  # uint64 throughout: numba types a uint64 mixed with an int64 as float64
        while u >= np.uint64(0x80):
            out[pos] = np.uint8((u & np.uint64(0x7F)) | np.uint64(0x80))
            u >>= np.uint64(7)
            pos += 1
        out[pos] = np.uint8(u)
        return pos + 1

    @_numba.njit(cache=True, nogil=True)
    def _pack_varints_kernel(a, out):  # pragma: no cover - compiled
        """LEB128 of each uint64 of a into out (10 bytes a value suffice) -> bytes written."""
        pos = 0
        for v in a:
            pos = _put_varint(out, pos, v)
        return pos

    @_numba.njit(cache=True, nogil=True)
    def _varints_kernel(buf, pos, out):  # pragma: no cover - compiled
        """out.size varints from buf[pos:] -> the position after them; -1: truncated, -2: malformed
        (over 10 bytes, or a value of 2**64 or more)."""
        n = buf.shape[0]
        for j in range(out.shape[0]):
            value = np.uint64(0)
            for i in range(11):
                if i == 10:
                    return -2
                if pos >= n:
                    return -1
                b = np.uint64(buf[pos])
                pos += 1
                if i == 9 and b > 1:  # the tenth byte holds bit 63 only
                    return -2
                value |= (b & np.uint64(0x7F)) << np.uint64(7 * i)
                if b < 0x80:
                    break
            out[j] = value
        return pos

    @_numba.njit(cache=True, nogil=True)
    def _alphabet_kernel(first, gaps, out):  # pragma: no cover - compiled
        """out = first, then each value the last plus its gap plus one -> False if one passes int64
        (uint64 arithmetic: the room left above a value always fits)."""
        prev = np.int64(first)
        out[0] = prev
        for i in range(gaps.shape[0]):
            g = gaps[i]
            if g >= np.uint64(0x7FFFFFFFFFFFFFFF) - np.uint64(prev):
                return False
            prev = np.int64(np.uint64(prev) + g + np.uint64(1))
            out[i + 1] = prev
        return True

    @_numba.njit(cache=True, nogil=True)
    def _index_kernel(sym, lo, lut, out):  # pragma: no cover - compiled
        for i in range(sym.shape[0]):
            out[i] = lut[sym[i] - lo]
