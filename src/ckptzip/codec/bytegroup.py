"""Byte-grouped floats + zstd (the ZipNN idea), lossless.

Floats compress badly as interleaved bytes because the exponent byte (low entropy) sits between
mantissa bytes (near-random). We rotate each word left by one bit, so that the sign lands in the
lowest bit and the exponent fills the top byte, then split the words into byte planes (all top
bytes, then all next bytes, ...) and compress each plane as its own zstd frame: the exponent plane
shrinks a lot, the mantissa planes hardly at all. Integers are only byte-grouped.

Blob layout: ``u8 width | u8 flags(bit0: rotated) | u64 n_words | u32 plane_len[width] | planes``
(little-endian; planes most-significant byte first). A plane that zstd cannot shrink is stored raw
(its length has bit 31 set).

Planes are zstd frames compressed with ``frames.zstd_compress(plane=True)`` (the level's match
finder narrowed to long matches: faster and smaller on planes); ``plane=False`` is the plain-level
reference. Both are standard zstd frames: the reader does not know which wrote them.

Speed: splitting words into planes (and, for a delta, XOR with the previous words, and with
``advance`` the store of the new words over them) is one numba pass (``backend="auto"``); the numpy
reference below gives the same planes (tests compare). The same for the merge on decompress, with a
parent's words XORed back in (:func:`decompress_words`). Each word width has its own kernels with a
loop per case (:func:`_kernels`): a branch per word kept one generic loop from vectorizing.
"""
from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Collection

import numpy as np

from ..errors import CorruptCheckpointError
from .frames import zstd_compress, zstd_decompress
from .scratch import scratch

try:  # optional fast path; the numpy reference is always available
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_RAW = 1 << 31


def _rotl1(words: np.ndarray, bits: int) -> np.ndarray:
    return (words << 1) | (words >> (bits - 1))


def _rotr1(words: np.ndarray, bits: int) -> np.ndarray:
    return (words >> 1) | (words << (bits - 1))


def split_planes(words: np.ndarray, rotate: bool, prev: np.ndarray | None = None, *,
                 backend: str = "auto", out: np.ndarray | None = None, advance: bool = False) -> np.ndarray:
    """(width, n) uint8 byte planes, most significant first, of ``words`` (uint, native order),
    XORed with ``prev`` first when given, each rotated left by one bit when ``rotate``; into
    ``out`` when given (numba backend). ``advance``: ``prev`` (writable) then holds ``words``."""
    width = words.dtype.itemsize
    if prev is None:
        advance = False
    if _use_numba(backend):
        out = np.empty((width, words.size), dtype=np.uint8) if out is None else out
        split, fused, _ = _KERNELS[width]
        if advance:  # the store in the split's pass (a kernel of its own: a read-only prev compiles none)
            fused(words, prev, rotate, out)
        else:
            split(words, prev if prev is not None else words[:0], rotate, out)
        return out
    x = words ^ prev if prev is not None else words
    x = _rotl1(x, 8 * width) if rotate else x
    out = np.ascontiguousarray(x.view(np.uint8).reshape(-1, width)[:, ::-1].T)
    if advance:
        prev[:] = words
    return out


def merge_planes(planes: np.ndarray, rotate: bool, dtype, *, backend: str = "auto",
                 prev: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`split_planes`: (width, n) planes -> n new words of ``dtype`` (uint, native
    order), XORed with ``prev`` (n words of ``dtype``) last when given, in the same pass."""
    if _use_numba(backend):
        out = np.empty(planes.shape[1], dtype=dtype)
        _KERNELS[planes.shape[0]][2](planes, rotate, prev if prev is not None else out[:0], out)
        return out
    out = np.ascontiguousarray(planes[::-1].T).view(dtype).reshape(-1)
    out = _rotr1(out, 8 * planes.shape[0]) if rotate else out
    if prev is not None:
        np.bitwise_xor(out, prev, out=out)
    return out


def compress(raw: bytes | memoryview, width: int, *, float_bits: bool = True, level: int = 3,
             prev: bytes | memoryview | None = None, plane: bool = True, store_raw: Collection[int] = (),
             advance: bool = False, min_gain: float = 0.0) -> bytes:
    """Byte-grouped zstd of ``raw`` (``width``-byte words); ``prev``: words of the same size to XOR
    with first (what a delta against the previous checkpoint stores), in the same pass; ``plane``:
    frames tuned for byte planes (False: zstd's plain ``level``); ``store_raw``: plane indices
    predicted not to shrink (a caller's prediction, e.g. the parent's same plane did not: the low
    mantissa planes of an XOR delta are near-random), stored raw unless zstd shrinks their first
    ``PROBE_BYTES`` (:func:`_probed_raw`); ``advance``: ``prev`` (a writable buffer)
    is then overwritten with ``raw`` (a caller that keeps the words as its next reference copies them
    into memory it holds already), in the split's pass; ``min_gain``: a plane zstd shrinks by less
    than this share is stored raw (0: any gain is kept), judged on the probe for a predicted one."""
    raw = memoryview(raw).cast("B")
    if width not in _UINT or len(raw) % width:
        raise ValueError(f"byte grouping needs a width in {sorted(_UINT)} dividing the data, got {width}")
    if prev is not None:
        prev = held = memoryview(prev).cast("B")
    words = _words(raw, width)
    if prev is not None:
        prev = _words(prev, width)
        if prev.size != words.size:
            raise ValueError(f"prev has {prev.size} words, raw {words.size}")
    rotate = bool(float_bits and width > 1)
    # (width, n): MSB first; ``advance`` writes the words into ``prev`` where it is the held buffer itself
    fused = advance and prev is not None and sys.byteorder == "little"  # prev is then a view of held
    planes = split_planes(words, rotate, prev, out=_planes_buffer(width, len(words)), advance=fused)
    if advance and prev is not None and not fused:
        held[:] = raw  # bytes for bytes: the words' order on this host does not matter
    keep_raw = _probed_raw(planes, store_raw, min_gain)
    parts = []
    for i, p in enumerate(planes):
        c = p.data if i in keep_raw else zstd_compress(p.data, level, plane=plane)
        parts.append(p.data if len(c) >= p.size * (1 - min_gain) else c)  # a plane zstd cannot shrink: raw
    lens = [len(c) | (_RAW if isinstance(c, memoryview) else 0) for c in parts]
    head = struct.pack(f"<BBQ{width}I", width, int(rotate), len(words), *lens)
    return b"".join([head, *parts])  # copies the raw planes out of the thread's planes buffer


PROBE_BYTES = 1 << 12  # a plane predicted raw is compressed whole only if this much of it promises a gain
_PROBE_GAIN = 0.01     # ... of at least this share (a near-random plane's histogram promises ~0.6 %)
_PROBE_BIAS = 0.02     # what the histogram of 4 KiB promises beyond zstd's gain on a near-random plane


def _probed_raw(planes: np.ndarray, store_raw: Collection[int], min_gain: float = 0.0) -> frozenset[int]:
    """Of the planes predicted not to shrink (``store_raw``), those to store raw without trying zstd:
    where the byte histogram of the first PROBE_BYTES promises less than ``min_gain`` (plus what it
    over-promises, ``_PROBE_BIAS``; and 1 %). zstd's frames of a plane are Huffman-coded literals
    (matches of 7+ bytes are rare in numbers), so the order-0 entropy tells what zstd would save: a
    histogram costs ~2 us where a zstd probe of 4 KiB cost ~7 us, and a small chain's delta probes
    ~150 planes (one kernel call a tensor: a call a plane cost more than its histogram). Every save
    probes, so a plane that becomes compressible is caught at once."""
    if planes.shape[1] <= PROBE_BYTES:
        return frozenset()
    rows = [i for i in range(planes.shape[0]) if i in store_raw]
    if not rows:
        return frozenset()
    floor = max(_PROBE_GAIN, min_gain + _PROBE_BIAS)
    return frozenset(i for i, g in zip(rows, sample_gains(planes, rows, PROBE_BYTES)) if g < floor)


def _gain_py(counts: np.ndarray, n: int, terms: np.ndarray) -> float:
    """1 - H / 8 of n bytes of these 256 counts (H: their order-0 entropy in bits a byte), its terms
    c * log2(c / n) looked up in ``terms`` (:func:`_gain_terms`: a log a bin cost a third of a probe)
    and summed bin by bin in order: the numba kernel and the reference agree bit for bit."""
    acc = 0.0
    for c in counts:
        if c:
            acc += terms[c]
    return 1.0 + acc / (8.0 * n)


@functools.lru_cache(maxsize=8)
def _gain_terms(n: int) -> np.ndarray:
    """c * log2(c / n) for c in 0..n (0 at c = 0)."""
    c = np.arange(1, n + 1, dtype=np.float64)
    return np.concatenate([np.zeros(1), c * np.log2(c / n)])


def sample_gains(planes: np.ndarray, rows: list[int], n: int, *, backend: str = "auto") -> list[float]:
    """The share of the first ``n`` bytes of each of ``planes``' ``rows`` (a (planes, bytes) uint8
    array) an order-0 coder saves, ideally (``_gain_py``)."""
    n = min(n, planes.shape[1])
    if not n:
        return [0.0] * len(rows)
    if _use_numba(backend):
        out = np.empty(len(rows), dtype=np.float64)
        _sample_gains_kernel(planes, np.asarray(rows, dtype=np.int64), n, _gain_terms(n), out)
        return out.tolist()
    return [float(_gain_py(np.bincount(planes[r, :n], minlength=256), n, _gain_terms(n))) for r in rows]


_SCRATCH_MAX = 1 << 23  # planes up to 8 MiB are split into one buffer per thread, reused


def _planes_buffer(width: int, n: int) -> np.ndarray:
    """(width, n) uint8 for :func:`compress`'s planes: a view of this thread's reusable buffer (a fresh
    array per call costs its page faults every time: ~10 % of a small tensor's compress) unless large."""
    return scratch("planes", width * n, np.uint8, keep=_SCRATCH_MAX).reshape(width, n)


def raw_planes(blob: bytes | memoryview) -> tuple[int, ...]:
    """The indices of the planes ``blob`` (written by :func:`compress`) stores raw."""
    return tuple(i for i, ln in enumerate(struct.unpack_from(f"<{blob[0]}I", blob, 10)) if ln & _RAW)


def decompress(blob: bytes | memoryview) -> bytes:
    """Inverse of :func:`compress` without a prev: the little-endian bytes of the words."""
    words = decompress_words(blob)
    return words.astype(_LE[words.itemsize], copy=False).tobytes()


def decompress_words(blob: bytes | memoryview, prev: np.ndarray | None = None) -> np.ndarray:
    """The blob's words as a new, writable array (unsigned ints, native order), XORed with ``prev``
    (as many words of that width) when given: a delta's words undone without another pass."""
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
    if prev is not None and (prev.dtype != _UINT[width] or prev.size != n):
        raise CorruptCheckpointError(f"byte-grouped blob holds {n} words of {width} bytes, its parent "
                                     f"{prev.size} of {prev.itemsize}")
    for i, ln in enumerate(lens):
        size = ln & ~_RAW
        chunk = blob[off:off + size]
        off += size
        # the size a plane promises is checked before allocating: a corrupt word count or frame
        # header must not ask for terabytes (MemoryError is not a typed error)
        if ln & _RAW:
            if size != n:
                raise CorruptCheckpointError(f"byte plane {i} holds {size} bytes, expected {n}")
            p = chunk
        else:
            p = zstd_decompress(chunk, max_bytes=n, exact=True, what=f"byte plane {i}")
        if i == 0:
            planes = np.empty((width, n), dtype=np.uint8)
        planes[i] = np.frombuffer(p, dtype=np.uint8)
    return merge_planes(planes, bool(flags & 1), _UINT[width], prev=prev)


_LE = {w: np.dtype(t).newbyteorder("<") for w, t in _UINT.items()}


def _words(buf, width: int) -> np.ndarray:
    """Little-endian words of ``buf`` in native order (the kernels want native; no copy on LE hosts)."""
    a = np.frombuffer(buf, dtype=_LE[width])
    return a if sys.byteorder == "little" else a.astype(_UINT[width])


def _use_numba(backend: str) -> bool:
    if backend not in ("auto", "numba", "numpy"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    if backend == "numba" and _numba is None:
        raise ValueError("backend='numba' needs numba installed; use backend='auto'")
    return _numba is not None and backend != "numpy"


if _numba is not None:
    _gain_kernel = _numba.njit(cache=True, nogil=True)(_gain_py)

    from .streamframe import _count_kernel  # the coders' byte count pass

    @_numba.njit(cache=True, nogil=True)
    def _sample_gains_kernel(planes, rows, n, terms, out):  # pragma: no cover - compiled
        counts = np.empty(256, dtype=np.int64)
        for k in range(rows.size):
            counts[:] = 0
            _count_kernel(planes[rows[k], :n], 0, counts)
            out[k] = _gain_kernel(counts, n, terms)

    # word helpers; W (bytes a word) is a constant of each kernel below, so these unroll
    @_numba.njit(inline="always")
    def _put(o, i, v, W):  # pragma: no cover - compiled
        for b in range(W):
            o[b, i] = np.uint8((v >> np.uint64(8 * (W - 1 - b))) & np.uint64(0xFF))

    @_numba.njit(inline="always")
    def _get(p, i, W):  # pragma: no cover - compiled
        v = np.uint64(0)
        for b in range(W):
            v = (v << np.uint64(8)) | np.uint64(p[b, i])
        return v

    @_numba.njit(inline="always")
    def _rotl(v, W):  # pragma: no cover - compiled
        mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * W)
        return ((v << np.uint64(1)) | (v >> np.uint64(8 * W - 1))) & mask

    @_numba.njit(inline="always")
    def _rotr(v, W):  # pragma: no cover - compiled
        mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - 8 * W)
        return ((v >> np.uint64(1)) | (v << np.uint64(8 * W - 1))) & mask


def _kernels(width: int):
    """(split, split with the store of ``advance``, merge) for words of ``width`` bytes. One set per
    width, each with a loop per case (XOR or not, rotated or not): a test of the width, the XOR or
    the rotation per word kept the one generic loop from vectorizing (30-40 % slower). Arithmetic in
    uint64: numba would type a uint32 shifted by an int64 as float64. The kernels close over the
    width alone (an int): numba's cache key hashes a closure's values, and a closure over other
    compiled functions missed the cache in every new process."""
    W = width

    @_numba.njit(cache=True, nogil=True)
    def split(words, prev, rotate, out):  # pragma: no cover - compiled
        n = words.shape[0]
        if prev.shape[0] != n:
            if rotate:
                for i in range(n):
                    _put(out, i, _rotl(np.uint64(words[i]), W), W)
            else:
                for i in range(n):
                    _put(out, i, np.uint64(words[i]), W)
        elif rotate:
            for i in range(n):
                _put(out, i, _rotl(np.uint64(words[i] ^ prev[i]), W), W)
        else:
            for i in range(n):
                _put(out, i, np.uint64(words[i] ^ prev[i]), W)

    @_numba.njit(cache=True, nogil=True)
    def fused(words, prev, rotate, out):  # pragma: no cover - compiled
        if rotate:
            for i in range(words.shape[0]):
                w = words[i]
                _put(out, i, _rotl(np.uint64(w ^ prev[i]), W), W)
                prev[i] = w
        else:
            for i in range(words.shape[0]):
                w = words[i]
                _put(out, i, np.uint64(w ^ prev[i]), W)
                prev[i] = w

    @_numba.njit(cache=True, nogil=True)
    def merge(planes, rotate, prev, out):  # pragma: no cover - compiled
        n = out.shape[0]
        if prev.shape[0] != n:
            if rotate:
                for i in range(n):
                    out[i] = _rotr(_get(planes, i, W), W)
            else:
                for i in range(n):
                    out[i] = _get(planes, i, W)
        elif rotate:
            for i in range(n):
                out[i] = _rotr(_get(planes, i, W), W) ^ np.uint64(prev[i])
        else:
            for i in range(n):
                out[i] = _get(planes, i, W) ^ np.uint64(prev[i])

    return split, fused, merge


_KERNELS = {w: _kernels(w) for w in _UINT} if _numba is not None else {}
