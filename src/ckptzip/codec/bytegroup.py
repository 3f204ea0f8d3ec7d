"""Byte-grouped floats + zstd (the ZipNN idea), lossless.

Floats compress badly as interleaved bytes because the exponent byte (low entropy) sits between
mantissa bytes (near-random). We rotate each word left by one bit, so that the sign lands in the
lowest bit and the exponent fills the top byte, then split the words into byte planes (all top
bytes, then all next bytes, ...) and compress each plane as its own zstd frame: the exponent plane
shrinks a lot, the mantissa planes hardly at all. Integers are only byte-grouped.

Blob layout: ``u8 width | u8 flags(bit0: rotated, bit1: sparse planes, bit2: a segment follows) | u64 n_words |
u32 plane_len[width] | [u8 sparse marks, with bit1] | planes`` (little-endian; planes most-significant
byte first). A plane that zstd cannot shrink is stored raw (its length has bit 31 set). Where the
writer asks (``sparse=True``: stage ``bytegroup/2``), a plane at most half of whose bytes are
nonzero -- the exponent plane of an XOR delta, whose exponents mostly did not change -- is stored
sparse (bit i of the marks byte): ``u32 m | zstd frame of its nonzero mask (m bytes, one bit a
byte, first byte in the top bit, np.packbits' order) | zstd frame of its nonzero bytes in order``.
zstd's time goes with the bytes it scans, and a plane 70 % zeros in short runs is mostly literals:
the two frames of its 1/8-size mask and its nonzero bytes take half the time of one over the plane,
and are ~25 % smaller (docs/BENCHMARKS.md, "Sparse exponent planes"). A tensor of more than
SEGMENT_WORDS words is stored as segments of that many words, each a blob as above, back to back,
all but the last with flags bit 2 set (also ``bytegroup/2``): a plane's u32 length could not hold
2 GiB, and such blobs, written before segments, were unreadable.

Planes are zstd frames compressed with ``frames.zstd_compress(plane=True)`` (the level's match
finder narrowed to long matches: faster and smaller on planes); ``plane=False`` is the plain-level
reference. Both are standard zstd frames: the reader does not know which wrote them.

Decode recipe, per segment: read the header; per plane, take the raw bytes, decompress its frame,
or (marked sparse) decompress the mask and then the nonzero bytes, and put them back where the
mask says (:func:`sparse_merge`); interleave the planes into words, rotate right by one bit when
flagged, XOR the parent's words back in for a delta; while flags bit 2 says so, the next segment's
words follow.

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
from . import stages as S
from .frames import zstd_compress, zstd_content_size, zstd_decompress
from .scratch import scratch

try:  # optional fast path; the numpy reference is always available
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_RAW = 1 << 31
_ROTATED, _SPARSE, _MORE = 1, 2, 4  # flags
SEGMENT_WORDS = 1 << 30  # words a segment holds at most: its planes' u32 lengths (bit 31: raw) stay below 2**31
SPARSE_SHARE = 0.5   # a plane at most this share of whose bytes are nonzero is stored sparse (where asked)
SPARSE_MIN = 1 << 12  # ... if it has this many bytes: below, two frames' headers cost what the split saves
_SAMPLE_SHARE = 0.6  # a plane whose first PROBE_BYTES are more nonzero than this is not split at all


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
                 prev: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`split_planes`: (width, n) planes -> n new words of ``dtype`` (uint, native
    order), XORed with ``prev`` (n words of ``dtype``) last when given, in the same pass; into
    ``out`` (n words) when given."""
    if _use_numba(backend):
        out = np.empty(planes.shape[1], dtype=dtype) if out is None else out
        _KERNELS[planes.shape[0]][2](planes, rotate, prev if prev is not None else out[:0], out)
        return out
    words = np.ascontiguousarray(planes[::-1].T).view(dtype).reshape(-1)
    words = _rotr1(words, 8 * planes.shape[0]) if rotate else words
    if prev is not None:
        np.bitwise_xor(words, prev, out=words)
    if out is None:
        return words
    out[:] = words
    return out


def compress(raw: bytes | memoryview, width: int, *, float_bits: bool = True, level: int = 3,
             prev: bytes | memoryview | None = None, plane: bool = True, store_raw: Collection[int] = (),
             advance: bool = False, min_gain: float = 0.0, sparse: bool = False) -> bytes:
    """Byte-grouped zstd of ``raw`` (``width``-byte words); ``prev``: words of the same size to XOR
    with first (what a delta against the previous checkpoint stores), in the same pass; ``plane``:
    frames tuned for byte planes (False: zstd's plain ``level``); ``store_raw``: plane indices
    predicted not to shrink (a caller's prediction, e.g. the parent's same plane did not: the low
    mantissa planes of an XOR delta are near-random), stored raw unless zstd shrinks their first
    ``PROBE_BYTES`` (:func:`_probed_raw`); ``advance``: ``prev`` (a writable buffer)
    is then overwritten with ``raw`` (a caller that keeps the words as its next reference copies them
    into memory it holds already), in the split's pass; ``min_gain``: a plane zstd shrinks by less
    than this share is stored raw (0: any gain is kept), judged on the probe for a predicted one;
    ``sparse``: a plane zstd compresses may be stored sparse (module docstring; a blob with one is
    stage ``bytegroup/2``, :func:`stage`)."""
    raw = memoryview(raw).cast("B")
    if width not in _UINT or len(raw) % width:
        raise ValueError(f"byte grouping needs a width in {sorted(_UINT)} dividing the data, got {width}")
    held = None if prev is None else memoryview(prev).cast("B")
    if held is not None and len(held) != len(raw):
        raise ValueError(f"prev has {len(held) // width} words, raw {len(raw) // width}")
    opts = (float_bits, level, plane, store_raw, advance, min_gain, sparse)
    step = SEGMENT_WORDS * width
    if len(raw) <= step:
        return b"".join(_segment(raw, width, held, False, False, *opts))
    parts = []  # each segment's raw planes are views of its own planes array until the one join
    for o in range(0, len(raw), step):
        parts += _segment(raw[o:o + step], width, None if held is None else held[o:o + step],
                          o + step < len(raw), True, *opts)
    return b"".join(parts)


def _segment(raw: memoryview, width: int, held: memoryview | None, more: bool, fresh: bool, float_bits: bool,
             level: int, plane: bool, store_raw: Collection[int], advance: bool, min_gain: float,
             sparse: bool) -> list:
    """One segment's parts (header, marks, planes; raw planes as views of the planes array: of this
    thread's reused buffer unless ``fresh``); ``more``: another segment follows. The rest as compress's."""
    words = _words(raw, width)
    prev = None if held is None else _words(held, width)
    rotate = bool(float_bits and width > 1)
    # (width, n): MSB first; ``advance`` writes the words into ``prev`` where it is the held buffer itself
    fused = advance and prev is not None and sys.byteorder == "little"  # prev is then a view of held
    out = np.empty((width, len(words)), np.uint8) if fresh else _planes_buffer(width, len(words))
    planes = split_planes(words, rotate, prev, out=out, advance=fused)
    if advance and prev is not None and not fused:
        held[:] = raw  # bytes for bytes: the words' order on this host does not matter
    keep_raw = _probed_raw(planes, store_raw, min_gain)
    parts, marks = [], 0
    for i, p in enumerate(planes):
        c = p.data
        if i not in keep_raw:
            s = _sparse_frames(p, level, plane) if sparse else None
            c = zstd_compress(c, level, plane=plane) if s is None else s
        if len(c) >= p.size * (1 - min_gain):  # a plane zstd cannot shrink: raw
            c, s = p.data, None
        parts.append(c)
        marks |= (s is not None) << i
    lens = [len(c) | (_RAW if isinstance(c, memoryview) else 0) for c in parts]
    flags = int(rotate) | (_SPARSE if marks else 0) | (_MORE if more else 0)
    head = struct.pack(f"<BBQ{width}I", width, flags, len(words), *lens)
    return [head, bytes((marks,)) if marks else b"", *parts]


def compress_sparse(raw: bytes | memoryview, width: int, **kw) -> bytes:
    """Stage ``bytegroup/2``'s writer: :func:`compress` with ``sparse=True``."""
    return compress(raw, width, sparse=True, **kw)


def stage(*blobs: bytes | memoryview) -> str:
    """The stage blobs :func:`compress` wrote need (a record's, all read alike): ``bytegroup/2`` where
    one holds sparse planes or segments (what a reader must know to decode it), else ``bytegroup/1``."""
    v2 = any(b[1] & (_SPARSE | _MORE) for b in blobs)  # _MORE: set on the first of several segments
    return (S.BYTEGROUP2 if v2 else S.BYTEGROUP).descriptor


def _sparse_frames(p: np.ndarray, level: int, plane: bool) -> bytes | None:
    """A plane's sparse form (``u32 m | mask frame | nonzero bytes' frame``), or None where it is not
    sparse: under SPARSE_MIN bytes, or over SPARSE_SHARE nonzero (its first bytes tell most planes)."""
    n = p.size
    if n < SPARSE_MIN or np.count_nonzero(p[:PROBE_BYTES]) > _SAMPLE_SHARE * min(n, PROBE_BYTES):
        return None
    mask, nonzero = sparse_split(p)
    if nonzero.size > SPARSE_SHARE * n:
        return None
    m = zstd_compress(mask.data, level, plane=plane)
    return b"".join([struct.pack("<I", len(m)), m, zstd_compress(nonzero.data, level, plane=plane)])


def sparse_split(p: np.ndarray, *, backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """(mask, nonzero bytes) of a uint8 plane: bit 7 - i % 8 of mask byte i // 8 says p[i] != 0
    (``np.packbits(p != 0)``), and the nonzero bytes in order (``p[p != 0]``). The numba kernel's are
    views of this thread's buffers, valid until its next call."""
    if not _use_numba(backend):
        keep = p != 0
        return np.packbits(keep), p[keep]
    mask = scratch("sparse_mask", (p.size + 7) >> 3, np.uint8, keep=_SCRATCH_MAX)
    nonzero = scratch("sparse_bytes", p.size, np.uint8, keep=_SCRATCH_MAX)
    return mask, nonzero[:_sparse_split_kernel(p, mask, nonzero)]


def sparse_merge(mask: np.ndarray, nonzero: np.ndarray, out: np.ndarray, *, backend: str = "auto") -> None:
    """Inverse of :func:`sparse_split` into ``out`` (a uint8 plane); CorruptCheckpointError unless the
    mask has exactly as many bits set as ``nonzero`` has bytes, and none past the plane's end."""
    n = out.size
    if mask.size != (n + 7) >> 3 or (n & 7 and mask[-1] & (0xFF >> (n & 7))):
        raise CorruptCheckpointError(f"a sparse byte plane's mask does not fit its {n} bytes")
    if _use_numba(backend):
        used = _sparse_merge_kernel(mask, nonzero, out)
    else:
        keep = np.unpackbits(mask, count=n).astype(bool)
        used = int(np.count_nonzero(keep))
        out[:] = 0
        if used == nonzero.size:
            out[keep] = nonzero
    if used != nonzero.size:
        raise CorruptCheckpointError(f"a sparse byte plane's mask marks other than its {nonzero.size} nonzero bytes")


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
    heads = _segment_heads(blob)
    width, rotated, total = heads[0][1], heads[0][2] & _ROTATED, sum(h[3] for h in heads)
    if any(h[1] != width or h[2] & _ROTATED != rotated for h in heads):
        raise CorruptCheckpointError("byte-grouped blob's segments disagree on the word width or rotation")
    if prev is not None and (prev.dtype != _UINT[width] or prev.size != total):
        raise CorruptCheckpointError(f"byte-grouped blob holds {total} words of {width} bytes, its parent "
                                     f"{prev.size} of {prev.itemsize}")
    if len(heads) == 1:
        return _decode_segment(blob, heads[0], prev, None)
    for h in heads:  # every plane's promised size checked before the words of all are allocated
        _check_promises(blob, h)
    out, done = np.empty(total, dtype=_UINT[width]), 0
    for h in heads:
        n = h[3]
        _decode_segment(blob, h, None if prev is None else prev[done:done + n], out[done:done + n])
        done += n
    return out


def _segment_heads(blob: memoryview) -> list[tuple]:
    """Each segment's (start, width, flags, n, lens, marks, its planes' offset), the layout checked:
    known flags, a marks byte that marks only planes stored, a next segment where flagged, nothing after
    the last."""
    heads, start = [], 0
    while True:
        try:
            width, flags, n = struct.unpack_from("<BBQ", blob, start)
            if width not in _UINT or flags & ~(_ROTATED | _SPARSE | _MORE) or (flags & _ROTATED and width == 1):
                raise ValueError  # compress never writes these
            lens = struct.unpack_from(f"<{width}I", blob, start + 10)
            marks = blob[start + 10 + 4 * width] if flags & _SPARSE else 0
            if flags & _SPARSE and not 0 < marks < 1 << width or any(ln & _RAW for i, ln in enumerate(lens)
                                                                     if marks >> i & 1):
                raise ValueError  # a marks byte marks some planes, each stored sparse, not raw
        except (struct.error, ValueError, IndexError):
            raise CorruptCheckpointError("byte-grouped blob has a malformed header") from None
        off = start + 10 + 4 * width + (1 if flags & _SPARSE else 0)
        end = off + sum(ln & ~_RAW for ln in lens)
        if end > len(blob) or (flags & _MORE and end == len(blob)):
            raise CorruptCheckpointError(f"byte-grouped blob is truncated: {len(blob)} bytes, its planes need "
                                         f"{end}{' and another segment' if flags & _MORE else ''}")
        heads.append((start, width, flags, n, lens, marks, off))
        if not flags & _MORE:
            if end < len(blob):
                raise CorruptCheckpointError("byte-grouped blob has trailing bytes")
            return heads
        start = end


def _planes_of(blob: memoryview, head: tuple):
    """(index, stored length, raw, sparse, its bytes) of each plane of a segment."""
    _, _, _, _, lens, marks, off = head
    for i, ln in enumerate(lens):
        size = ln & ~_RAW
        yield i, size, bool(ln & _RAW), bool(marks >> i & 1), blob[off:off + size]
        off += size


def _check_promises(blob: memoryview, head: tuple) -> None:
    """Each plane of a segment holds, or its frames promise, the segment's word count (a frame that
    does not record its size is refused here: compress records it)."""
    n = head[3]
    for i, size, raw, sparse, chunk in _planes_of(blob, head):
        if raw:
            promised = size
        elif sparse:
            promised = n if _sparse_promises(chunk, n, f"byte plane {i}") else -1
        else:
            promised = zstd_content_size(chunk, what=f"byte plane {i}")
        if promised != n:
            raise CorruptCheckpointError(f"byte plane {i} of a segment of {n} words promises other than {n} bytes")


def _sparse_promises(chunk: memoryview, n: int, what: str) -> bool:
    """Whether a sparse plane's frames promise a mask of ``n`` bits and at most ``n`` nonzero bytes."""
    mask, nonzero = _sparse_frames_of(chunk, what)
    return zstd_content_size(mask, what=f"{what}'s mask") == (n + 7) >> 3 and \
        0 <= zstd_content_size(nonzero, what=f"{what}'s nonzero bytes") <= n


def _sparse_frames_of(chunk: memoryview, what: str) -> tuple[memoryview, memoryview]:
    """A sparse plane's two frames: ``u32 m | the mask's (m bytes) | the nonzero bytes'``."""
    if len(chunk) < 4 or struct.unpack_from("<I", chunk)[0] > len(chunk) - 4:
        raise CorruptCheckpointError(f"{what} is sparse but its mask's length does not fit it")
    m = 4 + struct.unpack_from("<I", chunk)[0]
    return chunk[4:m], chunk[m:]


def _decode_segment(blob: memoryview, head: tuple, prev: np.ndarray | None, out: np.ndarray | None) -> np.ndarray:
    """A segment's words (into ``out`` when given), XORed with ``prev`` (its parent words)."""
    width, flags, n = head[1], head[2], head[3]
    for i, size, raw, sparse, chunk in _planes_of(blob, head):
        # the size a plane promises is checked before allocating: a corrupt word count or frame
        # header must not ask for terabytes (MemoryError is not a typed error)
        if raw:
            if size != n:
                raise CorruptCheckpointError(f"byte plane {i} holds {size} bytes, expected {n}")
            p = chunk
        elif sparse:
            p = _sparse_parts(chunk, n, f"byte plane {i}")
        else:
            p = zstd_decompress(chunk, max_bytes=n, exact=True, what=f"byte plane {i}")
        if i == 0:
            planes = np.empty((width, n), dtype=np.uint8)
        if isinstance(p, tuple):
            sparse_merge(*p, planes[i])
        else:
            planes[i] = np.frombuffer(p, dtype=np.uint8)
    return merge_planes(planes, bool(flags & _ROTATED), _UINT[width], prev=prev, out=out)


def _sparse_parts(chunk: memoryview, n: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A sparse plane's (mask, nonzero bytes), each frame's size checked before it is decompressed
    (the nonzero bytes' against the plane's: :func:`sparse_merge` checks the mask's count)."""
    mask, nonzero = _sparse_frames_of(chunk, what)
    mask = zstd_decompress(mask, max_bytes=(n + 7) >> 3, exact=True, what=f"{what}'s mask")
    nonzero = zstd_decompress(nonzero, max_bytes=n, what=f"{what}'s nonzero bytes")
    return np.frombuffer(mask, dtype=np.uint8), np.frombuffer(nonzero, dtype=np.uint8)


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

    @_numba.njit(cache=True, nogil=True)
    def _sparse_split_kernel(p, mask, nonzero):  # pragma: no cover - compiled
        # two passes: the mask's loop vectorizes; the compaction stores every byte at the next free
        # place, which moves on only past a nonzero one (no branch). One loop doing both: 1.9x the time
        n = p.size
        for j in range(n >> 3):
            b = 0
            for i in range(8 * j, 8 * j + 8):
                b = (b << 1) | (p[i] != 0)
            mask[j] = b
        if n & 7:
            b = 0
            for i in range(n - (n & 7), n):
                b = (b << 1) | (p[i] != 0)
            mask[n >> 3] = b << (8 - (n & 7))
        k = 0
        for i in range(n):
            v = p[i]
            nonzero[k] = v
            k += v != 0
        return k

    @_numba.njit(cache=True, nogil=True)
    def _sparse_merge_kernel(mask, nonzero, out):  # pragma: no cover - compiled
        # each byte takes the next nonzero byte times its mask bit (no branch) while 8 more reads stay
        # inside ``nonzero``; the rest one by one. Unsigned indices: no wraparound test per access.
        # Returns the nonzero bytes used (-1: the mask marks more than there are).
        n, size = out.size, nonzero.size
        one, k, j, groups = np.uint64(1), np.uint64(0), np.uint64(0), np.uint64(n >> 3)
        if size >= 8:
            last = np.uint64(size - 8)
            while j < groups and k <= last:
                b = np.uint64(mask[j])
                base = j * np.uint64(8)
                for i in range(8):
                    f = (b >> np.uint64(7 - i)) & one
                    out[base + np.uint64(i)] = nonzero[k] * f
                    k += f
                j += one
        used = np.int64(k)
        for i in range(np.int64(j) * 8, n):
            if (mask[i >> 3] >> (7 - (i & 7))) & 1:
                if used >= size:
                    return -1
                out[i] = nonzero[used]
                used += 1
            else:
                out[i] = 0
        return used

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
