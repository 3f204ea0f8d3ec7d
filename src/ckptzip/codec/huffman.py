"""Canonical, length-limited Huffman coding of integer streams (DynaQuant §6, last stage).

Symbols are any int64 values, negative ones included (the RLE stream holds values as -v): the
coder works on the sorted list of *distinct* values that occur (the alphabet) and on each
symbol's rank in it, so no offset or zigzag mapping of the data is needed. Only the header
zigzags the first alphabet value. Call order::

    buf = huffman_encode(symbols)      # 1-D integers (numpy or torch) -> bytes
    out = huffman_decode(buf)          # -> 1-D numpy int64, equal to symbols

Code lengths are optimal (Moffat-Katajainen in-place minimum-redundancy code over the sorted
counts), then limited to ``max_code_len`` bits (default 24) by the Kraft-repair heuristic of
zlib/miniz: clamp, then lengthen the longest codes below the limit until the Kraft sum is 1.
Codes are canonical (deflate order: by length, then by symbol value), so only lengths are stored.

Buffer, byte by byte (varints are unsigned LEB128)::

    b"HF" 0x01                 magic + format version
    n (varint)                 number of symbols
    k (varint)                 number of distinct symbols (0 iff n == 0)
    alphabet                   zigzag varint of the smallest value, then k-1 varints (gap - 1)
    lengths (k x u8)           code length of each alphabet value, in value order (k >= 2 only)
    payload_bytes (varint)     (k >= 2 only)
    payload                    codes, MSB first, last byte zero-padded (k >= 2 only)
    crc32 (u32 LE)             of everything above

A single distinct symbol (k == 1) is stored with no payload at all.

Speed: numba kernels (bit-packing encoder with a 64-bit accumulator; table-driven decoder with
an 11-bit primary table and a canonical slow path for longer codes) run at >= 50 M symbols/s on
one core. ``backend="numpy"`` selects the plain reference: a vectorized numpy encoder that
writes identical bytes, and a bit-by-bit Python decoder (slow; for tests and numba-less hosts).
Every read in the decoder is bounds-checked: corrupt input raises CorruptCheckpointError.
"""
from __future__ import annotations

import numpy as np

from ..errors import CorruptCheckpointError
from .streamframe import (alphabet_header, as_symbols, open_alphabet_stream, seal, single_value_stream, symbol_table,
                          write_varint)

try:  # optional fast path
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["huffman_encode", "huffman_decode", "code_lengths", "canonical_codes", "MAX_CODE_LEN",
           "HAVE_NUMBA"]

HAVE_NUMBA = _numba is not None
MAX_CODE_LEN = 24        # default length limit; the format allows up to 32
_FORMAT_MAX_LEN = 32     # the decoder's 64-bit window always holds >= 57 bits after a refill
_PRIMARY_BITS = 11       # 2048-entry first-level decode table: fits in L1 with its values
_MAGIC = b"HF\x01"


def _jit(f):
    return _numba.njit(cache=True, nogil=True)(f) if HAVE_NUMBA else f


# =========================================================================== public API
def huffman_encode(symbols, *, max_code_len: int = MAX_CODE_LEN, backend: str = "auto") -> bytes:
    """Encode a 1-D integer stream. ``backend``: "auto" (numba if installed), "numba" or "numpy"."""
    if not 1 <= max_code_len <= _FORMAT_MAX_LEN:
        raise ValueError(f"max_code_len must be in [1, {_FORMAT_MAX_LEN}], got {max_code_len}")
    fast = _pick(backend)
    sym = as_symbols(symbols, narrow=fast)
    values, counts, index = symbol_table(sym)
    k = values.size
    if k > 1 << max_code_len:
        raise ValueError(f"{k} distinct symbols need codes longer than max_code_len={max_code_len}; "
                         "raise max_code_len (<= 32) or use the 'zstd' coder")
    out = alphabet_header(_MAGIC, sym.size, values)
    if k >= 2:
        lengths = code_lengths(counts, max_code_len, backend=backend)
        codes = canonical_codes(lengths)
        total_bits = int((counts * lengths.astype(np.int64)).sum())
        if fast:
            payload = np.zeros((total_bits + 7) // 8 + 8, dtype=np.uint8)  # slack for 4-byte stores
            used = _encode_kernel(index, codes, lengths.astype(np.int64), payload)
            payload = payload[:used]
        else:
            payload = _encode_numpy(index, codes, lengths)
        out += lengths.tobytes()
        write_varint(out, payload.size)
        out += payload.tobytes()
    return seal(out)


def huffman_decode(buf, *, backend: str = "auto") -> np.ndarray:
    """Inverse of :func:`huffman_encode` -> 1-D int64 array. Corrupt input: CorruptCheckpointError."""
    fast = _pick(backend)
    r, n, values = open_alphabet_stream(buf, _MAGIC, "huffman stream")
    single = single_value_stream(r, n, values)
    if single is not None:
        return single
    k = values.size
    lengths = np.frombuffer(r.take(k), dtype=np.uint8)
    nbytes = r.varint()
    payload = np.frombuffer(r.take(nbytes), dtype=np.uint8)
    r.expect_end()
    if int(lengths.min()) < 1 or int(lengths.max()) > _FORMAT_MAX_LEN:
        raise CorruptCheckpointError(f"huffman code lengths must lie in [1, {_FORMAT_MAX_LEN}]")
    maxlen = int(lengths.max())
    if int((np.int64(1) << (maxlen - lengths.astype(np.int64))).sum()) > 1 << maxlen:
        raise CorruptCheckpointError("huffman code lengths violate the Kraft inequality")
    if n > 8 * nbytes:
        raise CorruptCheckpointError(f"huffman payload of {nbytes} bytes cannot hold {n} symbols")
    t = _DecodeTables(values, lengths)
    out = np.empty(n, dtype=np.int64)
    if fast:
        used_bits = _decode_kernel(payload, n, t.k_bits, t.maxlen, t.table_len, t.table_val,
                                   t.first, t.count, t.offset, t.canon_values, out)
    else:
        used_bits = _decode_python(payload, n, t, out)
    if used_bits < 0:
        raise CorruptCheckpointError("huffman payload is truncated or holds an invalid code")
    if (used_bits + 7) // 8 != nbytes:
        raise CorruptCheckpointError(f"huffman payload has {nbytes} bytes but its codes use {used_bits} bits")
    return out


def code_lengths(counts, max_code_len: int = MAX_CODE_LEN, *, backend: str = "auto") -> np.ndarray:
    """Length-limited Huffman code lengths (uint8) for positive ``counts``, same order.

    One symbol gets length 0 (it needs no bits). Without limiting the lengths are optimal, so
    ``sum(counts * lengths)`` equals any optimal Huffman code's total.
    """
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    k = counts.size
    if k == 0:
        return np.zeros(0, dtype=np.uint8)
    if int(counts.min()) <= 0:
        raise ValueError("code_lengths needs counts > 0; drop symbols that never occur")
    if k == 1:
        return np.zeros(1, dtype=np.uint8)
    if k > 1 << max_code_len:
        raise ValueError(f"{k} symbols cannot be coded in max_code_len={max_code_len} bits")
    fast = _pick(backend)
    order = np.argsort(counts, kind="stable")            # ascending frequency
    work = counts[order].copy()
    (_min_redundancy if fast else _min_redundancy_py)(work)
    (_limit_lengths if fast else _limit_lengths_py)(work, max_code_len)
    lengths = np.empty(k, dtype=np.uint8)
    lengths[order] = work
    return lengths


def canonical_codes(lengths) -> np.ndarray:
    """Canonical (deflate-order) code of each symbol from its length -> uint64, same order."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    codes = np.zeros(lengths.size, dtype=np.uint64)
    if lengths.size == 0 or int(lengths.max()) == 0:
        return codes
    first, _, offset = _canonical_starts(lengths)
    order = np.argsort(lengths, kind="stable")           # by length, then by symbol (value order)
    ls = lengths[order]
    rank = np.arange(lengths.size, dtype=np.int64) - offset[ls]
    codes[order] = (first[ls] + rank).astype(np.uint64)
    codes[lengths == 0] = 0
    return codes


# =========================================================================== internals
def _pick(backend: str) -> bool:
    if backend not in ("auto", "numba", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    if backend == "numba" and not HAVE_NUMBA:
        raise ValueError("backend='numba' needs numba installed; use backend='auto'")
    return HAVE_NUMBA and backend != "numpy"


def _canonical_starts(lengths: np.ndarray):
    """first[l]: first code of length l; count[l]; offset[l]: symbols with shorter codes."""
    maxlen = int(lengths.max())
    count = np.bincount(lengths, minlength=maxlen + 1).astype(np.int64)
    count[0] = 0
    first = np.zeros(maxlen + 1, dtype=np.int64)
    offset = np.zeros(maxlen + 1, dtype=np.int64)
    code = off = 0
    for l in range(1, maxlen + 1):
        code = (code + int(count[l - 1])) << 1
        first[l] = code
        offset[l] = off
        off += int(count[l])
    return first, count, offset


class _DecodeTables:
    """Primary table over the first k_bits bits of the window + canonical slow-path arrays."""

    def __init__(self, values: np.ndarray, lengths: np.ndarray):
        lengths = lengths.astype(np.int64)
        self.maxlen = int(lengths.max())
        self.first, self.count, self.offset = _canonical_starts(lengths)
        order = np.argsort(lengths, kind="stable")
        self.canon_values = values[order]
        ls = lengths[order]
        codes = self.first[ls] + np.arange(ls.size) - self.offset[ls]
        self.k_bits = kb = min(_PRIMARY_BITS, self.maxlen)
        self.table_len = np.zeros(1 << kb, dtype=np.int64)
        self.table_val = np.zeros(1 << kb, dtype=np.int64)
        short = ls <= kb
        span = np.int64(1) << (kb - ls[short])
        start = codes[short] << (kb - ls[short])
        slot = np.repeat(start - (np.cumsum(span) - span), span) + np.arange(int(span.sum()))
        self.table_len[slot] = np.repeat(ls[short], span)
        self.table_val[slot] = np.repeat(self.canon_values[short], span)


def _encode_numpy(index: np.ndarray, codes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Reference encoder: scatter every code bit into a bit array, then pack MSB first."""
    lens = lengths.astype(np.int64)[index]
    cods = codes[index]
    ends = np.cumsum(lens)
    starts = ends - lens
    bits = np.zeros(int(ends[-1]) if ends.size else 0, dtype=np.uint8)
    for b in range(int(lens.max()) if lens.size else 0):
        m = lens > b
        shift = (lens[m] - 1 - b).astype(np.uint64)
        bits[starts[m] + b] = ((cods[m] >> shift) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits)


def _decode_python(payload: np.ndarray, n: int, t: _DecodeTables, out: np.ndarray) -> int:
    """Reference decoder: one bit at a time against the canonical first/count tables."""
    bits = np.unpackbits(payload).tolist()
    first, count, offset = t.first.tolist(), t.count.tolist(), t.offset.tolist()
    pos = 0
    for i in range(n):
        code = 0
        for l in range(1, t.maxlen + 1):
            if pos >= len(bits):
                return -1
            code = (code << 1) | bits[pos]
            pos += 1
            d = code - first[l]
            if 0 <= d < count[l]:
                out[i] = t.canon_values[offset[l] + d]
                break
        else:
            return -1
    return pos


def _min_redundancy_py(a):
    """Moffat & Katajainen (1995) in-place minimum-redundancy code lengths.

    ``a``: int64 counts sorted ascending, len >= 2; overwritten with code lengths (which come
    out non-increasing). O(k) after the sort.
    """
    n = a.shape[0]
    a[0] += a[1]
    root = 0
    leaf = 2
    for nxt in range(1, n - 1):  # first pass: parent pointers, left to right
        if leaf >= n or a[root] < a[leaf]:
            a[nxt] = a[root]
            a[root] = nxt
            root += 1
        else:
            a[nxt] = a[leaf]
            leaf += 1
        if leaf >= n or (root < nxt and a[root] < a[leaf]):
            a[nxt] += a[root]
            a[root] = nxt
            root += 1
        else:
            a[nxt] += a[leaf]
            leaf += 1
    a[n - 2] = 0                 # second pass: internal node depths, right to left
    for nxt in range(n - 3, -1, -1):
        a[nxt] = a[a[nxt]] + 1
    avbl = 1                     # third pass: leaf depths
    used = 0
    dpth = 0
    root = n - 2
    nxt = n - 1
    while avbl > 0:
        while root >= 0 and a[root] == dpth:
            used += 1
            root -= 1
        while avbl > used:
            a[nxt] = dpth
            nxt -= 1
            avbl -= 1
        avbl = 2 * used
        dpth += 1
        used = 0


def _limit_lengths_py(lens, max_len):
    """Limit non-increasing code lengths to max_len, keeping the Kraft sum exactly 1 (miniz)."""
    if lens[0] <= max_len:
        return
    bl = np.zeros(max_len + 2, dtype=np.int64)
    for x in lens:
        bl[min(x, max_len)] += 1
    total = 0
    for l in range(1, max_len + 1):
        total += bl[l] << (max_len - l)
    while total > (1 << max_len):
        bl[max_len] -= 1  # drop one leaf at the limit, then split a shorter leaf into two
        for i in range(max_len - 1, 0, -1):
            if bl[i] > 0:
                bl[i] -= 1
                bl[i + 1] += 2
                break
        total -= 1
    j = lens.shape[0] - 1        # most frequent symbols (at the end) get the shortest codes
    for l in range(1, max_len + 1):
        for _ in range(bl[l]):
            lens[j] = l
            j -= 1


_min_redundancy = _jit(_min_redundancy_py)
_limit_lengths = _jit(_limit_lengths_py)


if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True)
    def _encode_kernel(index, codes, lens, out):  # pragma: no cover - compiled
        """Pack codes MSB first; flush 32 bits at a time. Returns bytes written."""
        acc = np.uint64(0)
        nacc = 0
        pos = 0
        for i in range(index.shape[0]):
            j = index[i]
            ln = lens[j]
            acc = (acc << np.uint64(ln)) | codes[j]
            nacc += ln
            if nacc >= 32:
                nacc -= 32
                w = acc >> np.uint64(nacc)
                out[pos] = np.uint8((w >> np.uint64(24)) & np.uint64(0xFF))
                out[pos + 1] = np.uint8((w >> np.uint64(16)) & np.uint64(0xFF))
                out[pos + 2] = np.uint8((w >> np.uint64(8)) & np.uint64(0xFF))
                out[pos + 3] = np.uint8(w & np.uint64(0xFF))
                pos += 4
        while nacc >= 8:
            nacc -= 8
            out[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
            pos += 1
        if nacc > 0:
            out[pos] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
            pos += 1
        return pos

    @_numba.njit(cache=True, nogil=True)
    def _decode_kernel(data, n, k_bits, maxlen, table_len, table_val, first, count, offset,
                       canon_values, out):  # pragma: no cover - compiled
        """Table-driven decode. Returns bits consumed, or -1 on a truncated/invalid stream."""
        nbytes = data.shape[0]
        buf = np.uint64(0)       # bit window, next bit in the MSB; zeros past the end of data
        nbits = 0                # real (not padding) bits in the window
        pos = 0
        consumed = 0
        kshift = np.uint64(64 - k_bits)
        for i in range(n):
            if nbits < maxlen:
                while nbits <= 56 and pos < nbytes:
                    buf |= np.uint64(data[pos]) << np.uint64(56 - nbits)
                    pos += 1
                    nbits += 8
            e = buf >> kshift
            ln = table_len[e]
            if ln != 0:
                out[i] = table_val[e]
            else:
                ln = 0
                for l in range(k_bits + 1, maxlen + 1):
                    d = np.int64(buf >> np.uint64(64 - l)) - first[l]
                    if d >= 0 and d < count[l]:
                        out[i] = canon_values[offset[l] + d]
                        ln = l
                        break
                if ln == 0:
                    return -1
            if ln > nbits:
                return -1
            buf = buf << np.uint64(ln)
            nbits -= ln
            consumed += ln
        return consumed
else:  # pragma: no cover
    _encode_kernel = _decode_kernel = None
