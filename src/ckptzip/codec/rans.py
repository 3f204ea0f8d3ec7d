"""Static interleaved rANS coding of integer streams with the empirical frequencies.

Same interface as codec/ans.py (whose constriction coder it replaces where speed matters)::

    buf = rans_encode(symbols)         # 1-D integers (numpy or torch) -> bytes
    out = rans_decode(buf)             # -> 1-D numpy int64, equal to symbols
    outs = rans_decode_many(bufs)      # the same for many streams, single-lane ones four at a time
    bufs = rans_encode_codes(cur, offsets, n_levels, prev, delta)  # many streams of codes (or their
                                       # cyclic deltas) in one numba call: rans_encode's bytes each

The coder is ryg_rans's 64-bit rANS: state x in [L, 2**32 L), L = 2**31, 32-bit words out, the
symbol counts normalized to a total of exactly M = 2**P, P = min(24, max(8, bit length of n))
(as ans.py: 24 bits of resolution for long streams, a total near n keeps short streams' headers
short). Symbol i goes to lane i mod ``lanes``: the lanes' states are independent dependency
chains that one core runs in parallel, sharing one word stream (the encoder runs backwards,
pushing words; the decoder reads them forwards in the same interleaved order). Each lane's
final state costs 8 bytes, so short payloads get fewer lanes (``choose_lanes``).

Encoding divides by a symbol's frequency with a reciprocal multiply (Alverson's method, as in
ryg_rans's Rans64EncPutSymbol) on a 64x64->128-bit product; decoding looks the slot's symbol up in a
table over the slot's top bits, then steps up the cumulative counts.

Buffer, byte by byte::

    b"RA" 0x01                 magic + format version
    n (varint)                 number of symbols
    k (varint)                 number of distinct symbols (0 iff n == 0)
    alphabet                   zigzag varint of the smallest value, then k-1 varints (gap - 1)
    freqs (k varints)          normalized counts in value order, each >= 1, summing to 2**P (k >= 2 only)
    lanes (u8)                 1, 2 or 4 (k >= 2 only)
    n_words (varint)           (k >= 2 only)
    words (n_words x u32 LE)   each lane's final state (high word, low word), lane 0 first, then
                               the renormalization words in decoding order (k >= 2 only)
    crc32 (u32 LE)             of everything above

A decoder that finishes with any lane's state other than L, or with words left, reports a
corrupt stream. Speed: numba kernels (``backend="numba"``, the default when numba is installed)
and a plain-Python reference that writes the same bytes (``backend="numpy"``; slow, for tests
and hosts without numba).
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from ..errors import CorruptCheckpointError
from ..inplace import addresses, segment
from .streamframe import (alphabet_header, as_symbols, open_alphabet_stream, pack_varints, seal, single_value_stream,
                          symbol_counts, write_varint)
from .huffman import HAVE_NUMBA, _pick
from .scratch import scratch

if HAVE_NUMBA:
    import numba as _numba

    from .streamframe import _count_kernel, _minmax_kernel, _put_varint  # the batch kernel's passes

__all__ = ["rans_encode", "rans_encode_codes", "rans_decode", "rans_decode_many", "normalize_counts", "choose_lanes",
           "PRECISION_BITS", "HAVE_NUMBA"]

PRECISION_BITS = 24
LANES = (1, 2, 4)
_MAX_DISTINCT = 1 << 22          # as ans.py: >= 4 units of 2**24 per symbol on average
_MAGIC = b"RA\x01"
_L = 1 << 31                     # lower bound of a lane's state
_MASK32 = (1 << 32) - 1
_LUT_BITS = 12                   # decode table over the slot's top bits: 16 KiB, in L1
# bytes of payload per extra lane: a lane's flush costs ~6 bytes over a single state's, so more
# lanes pay only where that stays near 0.1 % of the payload (docs/BENCHMARKS.md, issue 15)
_LANE_PAYLOAD = {4: 12_000, 2: 3_000}
_LANE_BITS = (8 * _LANE_PAYLOAD[4], 8 * _LANE_PAYLOAD[2])  # the kernels' copy
_MAGIC_BYTES = tuple(_MAGIC)
_SCRATCH_KEEP = 1 << 24  # rans_encode_codes's buffers kept per thread up to 16 MiB (a large model's: fresh)
# a batch stream whose values span at most this many keeps them (less the smallest) as its symbols:
# its encode table gets a row per value in the span, and no pass maps values to ranks
_VALUE_ROWS = 1024


# =========================================================================== public API
def rans_encode(symbols, *, lanes: int | None = None, backend: str = "auto") -> bytes:
    """Encode a 1-D integer stream under its own empirical distribution. ``lanes``: 1, 2 or 4
    interleaved states (None: by payload size, ``choose_lanes``). ``backend``: "auto" (numba if
    installed), "numba" or "numpy" (the plain reference, same bytes)."""
    fast = _pick(backend)
    sym = as_symbols(symbols, narrow=fast)
    values, counts, lo, lut = symbol_counts(sym)
    if lut is None:  # a sparse alphabet: the kernels read positions in values
        sym, lo, lut = np.searchsorted(values, sym).astype(np.int32), 0, np.arange(values.size, dtype=np.int32)
    k = values.size
    if k > _MAX_DISTINCT:
        raise ValueError(f"{k} distinct symbols exceed the rANS coder's {_MAX_DISTINCT}; "
                         "use the 'huffman' or 'zstd' coder")
    out = alphabet_header(_MAGIC, sym.size, values)
    if k < 2:
        return seal(out)
    P = precision_bits(sym.size)
    freqs = normalize_counts(counts, P, backend=backend)
    cost = _cost(counts, freqs, P)
    if lanes is None:
        lanes = choose_lanes(cost)
    if lanes not in LANES:
        raise ValueError(f"lanes must be one of {LANES}, got {lanes}")
    # a symbol adds at most its cost + log2(1 + M/L) bits to its lane's state (x' <= x M/f + M),
    # so the words pushed fit this bound (the kernel's buffer)
    cap = int(math.ceil((cost + sym.size * _GROWTH_SLACK * 2.0 ** (P - 31)) / 32 * (1 + 1e-9))) + 2 + lanes
    words = (_encode_numba if fast else _encode_python)(sym, lo, lut, freqs, P, lanes, cap)
    out += pack_varints(freqs)
    out.append(lanes)
    write_varint(out, words.size)
    out += words.astype("<u4", copy=False).tobytes()
    return seal(out)


def rans_encode_codes(curs: list[np.ndarray], n_levels, prevs: list[np.ndarray] | None = None,
                      delta=None) -> list[bytes | None]:
    """Many code streams in one kernel call (numba only): for each array s of ``curs``
    (C-contiguous 1-D, one integer dtype), the bytes ``rans_encode`` writes for it, or for the
    cyclic delta ``(prevs[s] - curs[s]) mod n_levels[s]`` where ``delta[s]`` (codec/delta.py; the
    prevs of one dtype). The kernel reads the arrays in place (inplace.py). None for an array the
    batch leaves to ``rans_encode``: a code outside [0, n_levels[s]), a sparse alphabet, counts the
    fast rounding cannot normalize. Per-stream Python work of the one-at-a-time path (~75 us a
    stream) is what this saves a save of hundreds of tensors."""
    if not HAVE_NUMBA:
        raise RuntimeError("rans_encode_codes needs numba; call rans_encode per stream")
    n_seg = len(curs)
    cur_at, offsets = addresses(curs, curs[0].dtype if n_seg else np.uint8)
    levels = np.ascontiguousarray(n_levels, dtype=np.int64)
    delta = np.zeros(n_seg, dtype=np.bool_) if delta is None else np.ascontiguousarray(delta, dtype=np.bool_)
    if not delta.any():
        prevs = []
    elif prevs is None or [p.size for p in prevs] != [c.size for c in curs]:
        raise ValueError(f"a delta needs prevs of the curs' sizes {[c.size for c in curs]}, got "
                         f"{None if prevs is None else [p.size for p in prevs]}")
    prev_at, _ = addresses(prevs, prevs[0].dtype) if prevs else (cur_at, None)
    sizes = np.diff(offsets)
    distinct = int(np.minimum(sizes, levels).sum())
    vals, freqs = np.empty(distinct, dtype=np.int64), np.empty(distinct, dtype=np.int64)
    ks, Ps, lanes, caps, rows = (np.zeros(n_seg, dtype=np.int64) for _ in range(5))
    vo = np.zeros(n_seg + 1, dtype=np.int64)
    status = np.zeros(n_seg, dtype=np.int8)
    # the symbols, then their ranks, in the narrowest type that holds every level
    top = int(levels.max()) - 1 if n_seg else 0
    dtype = next(t for t in (np.uint8, np.uint16, np.uint32, np.int64) if top <= np.iinfo(t).max)
    ranks = scratch(f"rans.ranks.{np.dtype(dtype).name}", int(offsets[-1]), dtype, keep=_SCRATCH_KEEP)
    like_cur = curs[0][:0] if n_seg else np.empty(0, np.uint8)
    _alphabets_kernel(cur_at, like_cur, prev_at, prevs[0][:0] if prevs else like_cur, offsets, delta, levels,
                      ranks, vals, freqs, vo, ks, Ps, lanes, caps, rows, status)
    # each stream's words within rans_encode's bound; the bytes: header, tables, words
    ends = np.cumsum(caps)
    words = scratch("rans.words", int(ends[-1] if n_seg else 0), np.uint32, keep=_SCRATCH_KEEP)
    out = scratch("rans.out", int((4 * caps + 20 * ks + 64).sum()), np.uint8, keep=_SCRATCH_KEEP)
    at = np.zeros(n_seg + 1, dtype=np.int64)
    _streams_kernel(offsets, ranks, vals, freqs, vo, ks, Ps, lanes, rows, words, ends, out, at, status)
    view = memoryview(out)
    return [None if status[s] else seal(view[at[s]:at[s + 1]]) for s in range(n_seg)]


def rans_decode(buf, *, backend: str = "auto", narrow: bool = False) -> np.ndarray:
    """Inverse of :func:`rans_encode` -> 1-D int64 array (``narrow``: uint8 where every value of
    the stream's alphabet is in [0, 255]). Corrupt input: CorruptCheckpointError."""
    s = _open(buf)
    return s if isinstance(s, np.ndarray) else _decode_one(s, _pick(backend), narrow)


def rans_decode_many(bufs, *, backend: str = "auto", threads: int | None = None) -> list[np.ndarray]:
    """``[rans_decode(b) for b in bufs]``, single-lane streams four at a time. A lane's decode is one
    chain of dependent loads and multiplies; four streams' chains overlap on one core (a restore's
    low-entropy streams are mostly single-lane: too short a payload for more lanes). ``threads``:
    the groups of four and the other streams spread over threads (default: torch's count)."""
    from ..parallel import default_threads, thread_map

    fast = _pick(backend)
    out: list = [None] * len(bufs)
    single, other = [], []
    for i, buf in enumerate(bufs):
        s = _open(buf)
        if isinstance(s, np.ndarray):
            out[i] = s
        else:
            (single if fast and s[3] == 1 else other).append((i, s))
    single.sort(key=lambda item: item[1][0])  # similar lengths together: less of a tail to run alone
    whole = len(single) - len(single) % 4
    jobs = other + single[whole:]  # (record index, opened stream), decoded alone
    if whole:
        group = [s for _, s in single[:whole]]
        words, freqs, values = (np.concatenate([s[j] for s in group]) for j in (4, 2, 1))
        ns = np.array([s[0] for s in group], dtype=np.int64)
        wo, fo, vo = (np.cumsum([0] + [s[j].size for s in group]) for j in (4, 2, 1))
        oo = np.concatenate(([0], np.cumsum(ns)))
        Ps = np.array([s[5] for s in group], dtype=np.int64)
        res = np.empty(int(oo[-1]), dtype=np.int64)
        ok = np.zeros(whole // 4, dtype=np.bool_)
        freqs = freqs.astype(np.uint64)
        # the groups in runs of about equal symbols, one job each, beside the other streams
        runs = min(len(ok), 4 * (default_threads() if threads is None else max(1, int(threads))))
        cuts = np.searchsorted(oo[4::4], np.linspace(0, oo[-1], runs + 1)[1:-1])
        bounds = [0, *sorted(set(int(c) + 1 for c in cuts)), len(ok)]
        jobs += [(None, (a, b)) for a, b in zip(bounds, bounds[1:]) if a < b]  # groups a..b-1

    def run(job):
        i, s = job
        if i is not None:
            return _decode_one(s, fast)
        _decode4_kernel(words, wo, freqs, fo, values, vo, Ps, ns, res, oo, ok, s[0], s[1])
        return None

    for (i, _), got in zip(jobs, thread_map(run, jobs, threads)):
        if i is not None:
            out[i] = got
    for j, (i, s) in enumerate(single[:whole]):
        # a group that fails holds a corrupt stream: each of its four alone raises its own error
        out[i] = res[oo[j]:oo[j + 1]] if ok[j // 4] else _decode_one(s, fast)
    return out


def _open(buf):
    """A stream's checked header -> its symbols (a stream of one value), else (n, values, freqs,
    lanes, words, P) for the decoder."""
    r, n, values = open_alphabet_stream(buf, _MAGIC, "rans stream", max_k=_MAX_DISTINCT)
    single = single_value_stream(r, n, values)
    if single is not None:
        return single
    k = values.size
    freqs = r.varints(k)
    lanes = r.u8()
    n_words = r.varint()
    words = np.frombuffer(r.take(4 * n_words), dtype="<u4")
    r.expect_end()
    fmax = int(freqs.max())
    total = int(freqs.sum()) if fmax <= 1 << PRECISION_BITS else 0
    P = total.bit_length() - 1
    if int(freqs.min()) < 1 or total != 1 << P or not 1 <= P <= PRECISION_BITS:
        raise CorruptCheckpointError("rans stream frequencies must be >= 1 and sum to a power of two <= 2**24")
    if lanes not in LANES or n_words < 2 * lanes:
        raise CorruptCheckpointError(f"rans stream has {lanes} lanes and {n_words} words")
    # pushing a symbol of frequency f grows a state x >= 2**(31-P) f by a factor of at least
    # 1 + (2**P - f) / f * (1 - 2**(P-31)) (x' - x = q (2**P - f) + start, q = x // f), and the
    # lanes' states end below 2**63 having started at L: the words bound the symbol count before
    # the output is allocated (a stream of one symbol at p ~ 1 - 2**-24 does hold ~3.7e8 a word)
    grow = math.log2(1 + ((1 << P) - fmax) / fmax * (1 - 2.0 ** (P - 31)))
    if n * grow > 32 * (n_words - lanes) + 1:
        raise CorruptCheckpointError(f"rans payload of {n_words} words cannot hold {n} symbols")
    return n, values, freqs, lanes, words, P


def _decode_one(opened, fast: bool, narrow: bool = False) -> np.ndarray:
    n, values, freqs, lanes, words, P = opened
    small = narrow and values.size and 0 <= int(values.min()) and int(values.max()) <= 255
    out = np.empty(n, dtype=np.uint8 if small else np.int64)
    ok = (_decode_kernel if fast else _decode_python)(words, n, lanes, freqs.astype(np.uint64), P, values, out)
    if not ok:
        raise CorruptCheckpointError("rans payload does not decode: truncated, or its states do not end where "
                                     "its symbols end")
    return out


def precision_bits(n: int) -> int:
    """P of a stream of ``n`` symbols (its frequencies sum to 2**P)."""
    return min(PRECISION_BITS, max(8, int(n).bit_length()))


def normalize_counts(counts, precision_bits: int, *, backend: str = "auto") -> np.ndarray:
    """Positive counts -> uint64 frequencies summing to exactly 2**precision_bits, each >= 1:
    the rounded scaled counts, the rounding's total error taken up by the most frequent symbol
    (too large an error for it, e.g. many symbols forced up to 1: a proportional share from
    every frequency above 1, then one unit at a time from the largest)."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    M = 1 << precision_bits
    if counts.size > M:
        raise ValueError(f"{counts.size} symbols cannot share a total of 2**{precision_bits}")
    q = np.empty(counts.size, dtype=np.int64)
    if (_round_counts if _pick(backend) else _round_counts_py)(counts, precision_bits, q):
        return q.astype(np.uint64)
    rem = M - int(q.sum())
    if rem > 0:  # pragma: no cover - the largest symbol takes any positive remainder
        q[np.argmax(q)] += rem
    else:
        spare = q - 1
        take = np.floor(spare * (-rem / spare.sum())).astype(np.int64)
        q -= take
        rem += int(take.sum())
        for i in np.argsort(-q, kind="stable"):
            if rem == 0:
                break
            d = min(-rem, int(q[i]) - 1)
            q[i] -= d
            rem += d
    return q.astype(np.uint64)


def choose_lanes(payload_bits: float) -> int:
    """Interleaved states for a payload of about ``payload_bits``."""
    for lanes, min_bytes in _LANE_PAYLOAD.items():
        if payload_bits >= 8 * min_bytes:
            return lanes
    return 1


# =========================================================================== internals
_GROWTH_SLACK = 1.5   # log2(1 + d) <= 1.4427 d: a state grows by at most cost + 1.5 M / L bits


def _cost_py(counts, freqs, P):
    """Bits the model charges the stream: sum of counts * -log2(f / 2**P), summed in symbol order
    (one order for every path: the lane count and the words' bound follow from it)."""
    total = 0.0
    for i in range(counts.size):
        total += counts[i] * (P - np.log2(np.float64(freqs[i])))
    return total


def _cost(counts: np.ndarray, freqs: np.ndarray, P: int) -> float:
    if HAVE_NUMBA:
        return float(_cost_kernel(counts, freqs, P))
    return float(np.dot(counts.astype(np.float64), P - np.log2(freqs.astype(np.float64))))  # no kernels: no batch


def _round_counts_py(counts, P, q):
    """q = max(1, rint(count * 2**P / n)); the error of the total goes to the most frequent symbol
    when that leaves it >= half its rounded share. False: left to normalize_counts's general path."""
    M = 1 << P
    n = 0
    for c in counts:
        n += c
    scale = M / n
    top = 0
    total = 0
    for i in range(counts.size):
        v = max(1, int(np.rint(counts[i] * scale)))
        q[i] = v
        total += v
        if counts[i] > counts[top]:
            top = i
    d = M - total
    if 2 * (q[top] + d) < q[top]:
        return False
    q[top] += d
    return True


def _starts(freqs: np.ndarray) -> np.ndarray:
    """Cumulative frequencies, k + 1 entries (the last is 2**P)."""
    return np.concatenate(([0], np.cumsum(freqs, dtype=np.uint64))).astype(np.uint64)


def _flush(states) -> list[int]:
    return [w for x in states for w in (int(x) >> 32, int(x) & _MASK32)]


def _encode_python(sym, lo, lut, freqs, P, lanes, cap) -> np.ndarray:
    """Reference encoder: exact integer division, one symbol at a time."""
    index = lut[sym - lo]
    f, st = freqs.tolist(), _starts(freqs).tolist()
    x = [_L] * lanes
    pushed = []
    xmax_unit = (_L >> P) << 32
    for i in range(len(index) - 1, -1, -1):
        j, s = i % lanes, int(index[i])
        xj, fs = x[j], f[s]
        if xj >= xmax_unit * fs:
            pushed.append(xj & _MASK32)
            xj >>= 32
        x[j] = ((xj // fs) << P) + xj % fs + st[s]
    if len(pushed) > cap:
        raise AssertionError("rans encoder pushed more words than its bound")  # pragma: no cover
    return np.array(_flush(x) + pushed[::-1], dtype=np.uint32)


def _decode_python(words, n, lanes, freqs, P, values, out) -> bool:
    """Reference decoder: Python integers, the symbol by binary search of the cumulative counts."""
    f, st = freqs.tolist(), _starts(freqs).tolist()
    w = words.tolist()
    x = [(w[2 * j] << 32) | w[2 * j + 1] for j in range(lanes)]
    pos, mask = 2 * lanes, (1 << P) - 1
    for i in range(n):
        j = i % lanes
        slot = x[j] & mask
        s = bisect.bisect_right(st, slot) - 1
        out[i] = values[s]
        xj = f[s] * (x[j] >> P) + slot - st[s]
        if xj < _L:
            if pos >= len(w):
                return False
            xj = (xj << 32) | w[pos]
            pos += 1
        x[j] = xj
    return pos == len(w) and all(v == _L for v in x)


def _encode_numba(sym, lo, lut, freqs, P, lanes, cap) -> np.ndarray:
    out = np.empty(cap + 2 * lanes, dtype=np.uint32)
    t = _encode_tables(freqs, P)
    pos = _encode_kernel(sym, lo, lut, t, lanes, out)
    if pos < 0:  # past the bound (it holds: never seen); a symbol pushes at most one word
        out = np.empty(sym.size + 4 * lanes + 1, dtype=np.uint32)  # pragma: no cover
        pos = _encode_kernel(sym, lo, lut, t, lanes, out)  # pragma: no cover
    return out[pos:]


if HAVE_NUMBA:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    _round_counts = _numba.njit(cache=True, nogil=True)(_round_counts_py)
    _cost_kernel = _numba.njit(cache=True, nogil=True)(_cost_py)

    @_intrinsic
    def _mulhi(typingctx, a, b):  # pragma: no cover - compiled
        """High 64 bits of the 128-bit product of two uint64: one multiply instruction."""
        def codegen(context, builder, signature, args):
            i128 = _ir.IntType(128)
            p = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
            return builder.trunc(builder.lshr(p, _ir.Constant(i128, 64)), _ir.IntType(64))
        return _types.uint64(_types.uint64, _types.uint64), codegen

    _U32 = np.uint64(32)
    _LO = np.uint64(_MASK32)
    _UL = np.uint64(_L)

    @_numba.njit(cache=True, nogil=True)
    def _encode_tables(freqs, P):  # pragma: no cover - compiled
        """The encode kernel's four uint64 a symbol, symbol s's at t[4s:4s+4] (Rans64EncSymbolInit):
        x_max (renormalize at or above it), the reciprocal of f, the bias, and 2**P - f | shift << 32;
        q = mulhi(x, rcp) >> shift is x // f for every state x < 2**63 (Alverson). Flat: a row's
        address is a shift of s, where a 2-D table's stride is a multiply in the loop."""
        M = np.uint64(1) << np.uint64(P)
        unit = np.uint64(((1 << 31) >> P) << 32)
        t = np.empty(4 * freqs.size, dtype=np.uint64)
        start = np.uint64(0)
        for s in range(freqs.size):
            f = freqs[s]
            t[4 * s] = unit * f
            if f == 1:  # x // 1: rcp 2**64 - 1 gives q = x - 1 at shift 0; the bias adds M - 1
                t[4 * s + 1] = np.uint64(0xFFFFFFFFFFFFFFFF)
                t[4 * s + 2] = start + M - np.uint64(1)
                t[4 * s + 3] = M - f
            else:
                shift = np.uint64(0)
                while f > (np.uint64(1) << shift):
                    shift += np.uint64(1)
                x1 = np.uint64(1) << (shift + np.uint64(31))
                t1 = x1 // f
                t0 = (f - np.uint64(1) + ((x1 % f) << _U32)) // f
                t[4 * s + 1] = t0 + (t1 << _U32)
                t[4 * s + 2] = start
                t[4 * s + 3] = (M - f) | ((shift - np.uint64(1)) << _U32)
            start += f
        return t

    @_numba.njit(inline="always")
    def _enc(x, t, s):  # pragma: no cover - compiled
        """Push symbol s (a rank: never negative) onto state x -> (new state, low word, whether
        the word is emitted)."""
        r = np.uint64(s) << np.uint64(2)  # unsigned: no wraparound test on the index
        e = x >= t[r]
        w = np.uint32(x & _LO)
        if e:
            x >>= _U32
        c = t[r + np.uint64(3)]
        q = _mulhi(x, t[r + np.uint64(1)]) >> (c >> _U32)
        return x + t[r + np.uint64(2)] + q * (c & _LO), w, e

    @_numba.njit(inline="always")
    def _push(x, t, s, out, pos):  # pragma: no cover - compiled
        """_enc, its word stored at out[pos - 1] -> (new state, pos less one if the word was emitted)."""
        x, w, e = _enc(x, t, s)
        out[pos - 1] = w
        return x, pos - np.int64(e)

    @_numba.njit(inline="always")
    def _push_u(x, t, s, out, pos):  # pragma: no cover - compiled
        """_push at an unsigned position: numba checks a signed index for wraparound per access."""
        x, w, e = _enc(x, t, s)
        out[pos - np.uint64(1)] = w
        return x, pos - np.uint64(e)

    @_numba.njit(inline="always")
    def _row(sym, i, lo, lut):  # pragma: no cover - compiled
        """Symbol i's row of the encode table: lut[sym[i] - lo], or sym[i] - lo without a lut (a
        None lut is a type: numba drops the other branch)."""
        if lut is None:
            return sym[i] - lo
        return lut[sym[i] - lo]

    @_numba.njit(cache=True, nogil=True)
    def _encode_kernel(sym, lo, lut, t, lanes, out):  # pragma: no cover - compiled
        """Encode sym (backwards; symbol v's row of the table t: lut[v - lo], or v - lo where lut
        is None) into out's tail, the lanes' final states in front -> the first word's position
        (-1: out too short). Words are stored always, kept when emitted."""
        pos = out.size
        x0 = x1 = x2 = x3 = _UL
        i = sym.size - 1
        while i >= 0 and i % lanes != lanes - 1:  # the tail of a partial group: lane = i % lanes
            j = i % lanes
            if j == 0:
                x0, pos = _push(x0, t, _row(sym, i, lo, lut), out, pos)
            elif j == 1:
                x1, pos = _push(x1, t, _row(sym, i, lo, lut), out, pos)
            else:
                x2, pos = _push(x2, t, _row(sym, i, lo, lut), out, pos)
            i -= 1
        # whole groups, one loop per lane count (a lane test inside the loop costs ~25 %); each
        # group first checks room for its words and the lanes' flush in front
        if lanes == 4:
            while i >= 3:
                m = min((i + 1) // 4, 64)
                if pos > 4 * m + 8:  # room for every word of m groups: unsigned, unchecked (as _encode_four)
                    u, q = np.uint64(i), np.uint64(pos)
                    for _ in range(m):
                        x3, q = _push_u(x3, t, _row(sym, u, lo, lut), out, q)
                        x2, q = _push_u(x2, t, _row(sym, u - np.uint64(1), lo, lut), out, q)
                        x1, q = _push_u(x1, t, _row(sym, u - np.uint64(2), lo, lut), out, q)
                        x0, q = _push_u(x0, t, _row(sym, u - np.uint64(3), lo, lut), out, q)
                        u -= np.uint64(4)
                    i, pos = i - 4 * m, np.int64(q)
                    continue
                if pos <= 12:
                    return -1
                x3, pos = _push(x3, t, _row(sym, i, lo, lut), out, pos)
                x2, pos = _push(x2, t, _row(sym, i - 1, lo, lut), out, pos)
                x1, pos = _push(x1, t, _row(sym, i - 2, lo, lut), out, pos)
                x0, pos = _push(x0, t, _row(sym, i - 3, lo, lut), out, pos)
                i -= 4
        elif lanes == 2:
            while i >= 1:
                m = min((i + 1) // 2, 64)
                if pos > 2 * m + 4:
                    u, q = np.uint64(i), np.uint64(pos)
                    for _ in range(m):
                        x1, q = _push_u(x1, t, _row(sym, u, lo, lut), out, q)
                        x0, q = _push_u(x0, t, _row(sym, u - np.uint64(1), lo, lut), out, q)
                        u -= np.uint64(2)
                    i, pos = i - 2 * m, np.int64(q)
                    continue
                if pos <= 6:
                    return -1
                x1, pos = _push(x1, t, _row(sym, i, lo, lut), out, pos)
                x0, pos = _push(x0, t, _row(sym, i - 1, lo, lut), out, pos)
                i -= 2
        else:
            while i >= 0:
                if pos <= 3:
                    return -1
                x0, pos = _push(x0, t, _row(sym, i, lo, lut), out, pos)
                i -= 1
        pos -= 2 * lanes
        for j in range(lanes):
            x = x0 if j == 0 else x1 if j == 1 else x2 if j == 2 else x3
            out[pos + 2 * j] = np.uint32(x >> _U32)
            out[pos + 2 * j + 1] = np.uint32(x & _LO)
        return pos

    @_numba.njit(inline="always")
    def _dec(x, freqs, st, lut, tshift, P, mask):  # pragma: no cover - compiled
        """Pop one symbol off state x -> (its alphabet index, the state before renormalizing)."""
        slot = x & mask
        s = lut[slot >> tshift]
        while st[s + 1] <= slot:
            s += 1
        return s, freqs[s] * (x >> P) + slot - st[s]

    @_numba.njit(inline="always")
    def _refill(x, word, pos):  # pragma: no cover - compiled
        """A state below L takes the next word (past the last word: the zero pad; the position
        still moves on, and the decoder's end check fails)."""
        if x < _UL:
            x = (x << _U32) | np.uint64(word)
            pos += 1
        return x, pos

    @_numba.njit(inline="always")
    def _tables(freqs, P):  # pragma: no cover - compiled
        """(cumulative counts, the table of a slot's first candidate symbol over its top bits, the
        shift to those bits)."""
        k = freqs.size
        st = np.empty(k + 1, dtype=np.uint64)
        st[0] = 0
        for s in range(k):
            st[s + 1] = st[s] + freqs[s]
        kb = 0
        while (1 << kb) <= k:
            kb += 1
        tbits = min(P, max(_LUT_BITS, kb + 1))
        lut = np.empty(1 << tbits, dtype=np.int32)
        s = 0
        for b in range(1 << tbits):
            v = np.uint64(b) << np.uint64(P - tbits)
            while st[s + 1] <= v:
                s += 1
            lut[b] = s
        return st, lut, np.uint64(P - tbits)

    @_numba.njit(inline="always")
    def _padded(words):  # pragma: no cover - compiled
        """words and a zero: words[min(pos, nw)] is always a valid read."""
        padded = np.zeros(words.size + 1, dtype=np.uint32)
        padded[:words.size] = words
        return padded

    @_numba.njit(inline="always")
    def _start(words):  # pragma: no cover - compiled
        return (np.uint64(words[0]) << _U32) | np.uint64(words[1])

    @_numba.njit(inline="always")
    def _run(x, pos, lo, hi, freqs, st, lut, ts, P, mask, values, out, padded, nw):  # pragma: no cover - compiled
        """One single-lane stream's symbols lo..hi-1 into out -> (its state, its word position)."""
        for i in range(lo, hi):
            s, x = _dec(x, freqs, st, lut, ts, P, mask)
            out[i] = values[s]
            x, pos = _refill(x, padded[min(pos, nw)], pos)
        return x, pos

    @_numba.njit(cache=True, nogil=True)
    def _decode4_kernel(words, wo, freqs, fo, values, vo, Ps, ns, out, oo, ok, g0, g1):  # pragma: no cover
        """Single-lane streams four at a time (stream j: words[wo[j]:wo[j+1]], freqs, values and
        out likewise, P Ps[j], ns[j] symbols), groups g0..g1-1 (group g: streams 4g..4g+3): one
        symbol of each in turn while all four have one, then each to its end. ok[g]:
        _decode_kernel's check of all four streams of group g."""
        for g in range(g0, g1):
            j = 4 * g
            w0, w1, w2, w3 = words[wo[j]:wo[j + 1]], words[wo[j + 1]:wo[j + 2]], \
                words[wo[j + 2]:wo[j + 3]], words[wo[j + 3]:wo[j + 4]]
            f0, f1, f2, f3 = freqs[fo[j]:fo[j + 1]], freqs[fo[j + 1]:fo[j + 2]], \
                freqs[fo[j + 2]:fo[j + 3]], freqs[fo[j + 3]:fo[j + 4]]
            v0, v1, v2, v3 = values[vo[j]:vo[j + 1]], values[vo[j + 1]:vo[j + 2]], \
                values[vo[j + 2]:vo[j + 3]], values[vo[j + 3]:vo[j + 4]]
            o0, o1, o2, o3 = out[oo[j]:oo[j + 1]], out[oo[j + 1]:oo[j + 2]], \
                out[oo[j + 2]:oo[j + 3]], out[oo[j + 3]:oo[j + 4]]
            st0, l0, t0 = _tables(f0, Ps[j])
            st1, l1, t1 = _tables(f1, Ps[j + 1])
            st2, l2, t2 = _tables(f2, Ps[j + 2])
            st3, l3, t3 = _tables(f3, Ps[j + 3])
            u0, u1, u2, u3 = np.uint64(Ps[j]), np.uint64(Ps[j + 1]), np.uint64(Ps[j + 2]), np.uint64(Ps[j + 3])
            m0, m1 = np.uint64((1 << Ps[j]) - 1), np.uint64((1 << Ps[j + 1]) - 1)
            m2, m3 = np.uint64((1 << Ps[j + 2]) - 1), np.uint64((1 << Ps[j + 3]) - 1)
            p0, p1, p2, p3 = _padded(w0), _padded(w1), _padded(w2), _padded(w3)
            n0, n1, n2, n3 = w0.size, w1.size, w2.size, w3.size
            x0, x1, x2, x3 = _start(w0), _start(w1), _start(w2), _start(w3)
            q0 = q1 = q2 = q3 = 2
            common = min(min(ns[j], ns[j + 1]), min(ns[j + 2], ns[j + 3]))  # symbols all four have
            for i in range(common):
                s, x0 = _dec(x0, f0, st0, l0, t0, u0, m0)
                o0[i] = v0[s]
                s, x1 = _dec(x1, f1, st1, l1, t1, u1, m1)
                o1[i] = v1[s]
                s, x2 = _dec(x2, f2, st2, l2, t2, u2, m2)
                o2[i] = v2[s]
                s, x3 = _dec(x3, f3, st3, l3, t3, u3, m3)
                o3[i] = v3[s]
                x0, q0 = _refill(x0, p0[min(q0, n0)], q0)
                x1, q1 = _refill(x1, p1[min(q1, n1)], q1)
                x2, q2 = _refill(x2, p2[min(q2, n2)], q2)
                x3, q3 = _refill(x3, p3[min(q3, n3)], q3)
            x0, q0 = _run(x0, q0, common, ns[j], f0, st0, l0, t0, u0, m0, v0, o0, p0, n0)
            x1, q1 = _run(x1, q1, common, ns[j + 1], f1, st1, l1, t1, u1, m1, v1, o1, p1, n1)
            x2, q2 = _run(x2, q2, common, ns[j + 2], f2, st2, l2, t2, u2, m2, v2, o2, p2, n2)
            x3, q3 = _run(x3, q3, common, ns[j + 3], f3, st3, l3, t3, u3, m3, v3, o3, p3, n3)
            ok[g] = (q0 == n0 and q1 == n1 and q2 == n2 and q3 == n3
                     and x0 == _UL and x1 == _UL and x2 == _UL and x3 == _UL)

    @_numba.njit(cache=True, nogil=True)
    def _decode_kernel(words, n, lanes, freqs, P, values, out):  # pragma: no cover - compiled
        """Decode n symbols into out -> False when the words run out, or do not end with every
        lane back at L. The symbol of a slot: a table over its top bits gives the first candidate,
        then the cumulative counts are stepped up (rarely more than one step)."""
        st, lut, ts = _tables(freqs, P)
        mask = np.uint64((1 << P) - 1)
        up = np.uint64(P)
        nw = words.size
        padded = _padded(words)
        x = np.full(4, _UL, dtype=np.uint64)
        for j in range(lanes):
            x[j] = (np.uint64(words[2 * j]) << _U32) | np.uint64(words[2 * j + 1])
        x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
        pos = 2 * lanes
        i = 0
        whole = n - n % lanes
        # one loop per lane count, as in the encoder
        if lanes == 4:
            while i < whole:
                s, x0 = _dec(x0, freqs, st, lut, ts, up, mask)
                out[i] = values[s]
                s, x1 = _dec(x1, freqs, st, lut, ts, up, mask)
                out[i + 1] = values[s]
                s, x2 = _dec(x2, freqs, st, lut, ts, up, mask)
                out[i + 2] = values[s]
                s, x3 = _dec(x3, freqs, st, lut, ts, up, mask)
                out[i + 3] = values[s]
                x0, pos = _refill(x0, padded[min(pos, nw)], pos)
                x1, pos = _refill(x1, padded[min(pos, nw)], pos)
                x2, pos = _refill(x2, padded[min(pos, nw)], pos)
                x3, pos = _refill(x3, padded[min(pos, nw)], pos)
                i += 4
        elif lanes == 2:
            while i < whole:
                s, x0 = _dec(x0, freqs, st, lut, ts, up, mask)
                out[i] = values[s]
                s, x1 = _dec(x1, freqs, st, lut, ts, up, mask)
                out[i + 1] = values[s]
                x0, pos = _refill(x0, padded[min(pos, nw)], pos)
                x1, pos = _refill(x1, padded[min(pos, nw)], pos)
                i += 2
        else:
            x0, pos = _run(x0, pos, 0, whole, freqs, st, lut, ts, up, mask, values, out, padded, nw)
            i = whole
        for j in range(n - whole):  # a partial group: lanes 0, 1, 2
            xj = x0 if j == 0 else x1 if j == 1 else x2
            s, xj = _dec(xj, freqs, st, lut, ts, up, mask)
            out[i + j] = values[s]
            xj, pos = _refill(xj, padded[min(pos, nw)], pos)
            if j == 0:
                x0 = xj
            elif j == 1:
                x1 = xj
            else:
                x2 = xj
        return pos == nw and x0 == _UL and x1 == _UL and x2 == _UL and x3 == _UL

    @_numba.njit(cache=True, nogil=True)
    def _alphabets_kernel(cur_at, like_cur, prev_at, like_prev, offsets, delta, levels, ranks, vals, freqs, vo, ks,
                          Ps, lanes, caps, rows, status):  # pragma: no cover - compiled
        """rans_encode_codes's first pass: each segment's symbols (ranks[a:e]: values less the
        smallest where rows[s] > 0, the span; else ranks in its alphabet), the alphabet
        (vals[vo[s]:vo[s+1]]), its frequencies, P, lanes and the words its stream may push
        (rans_encode's bound); status[s] = 1: left to rans_encode. Segment s's codes (and its
        prev's) are read in place at cur_at[s] (prev_at[s])."""
        for s in range(offsets.size - 1):
            vo[s + 1] = vo[s]
            a, n, B = offsets[s], offsets[s + 1] - offsets[s], levels[s]
            c, r = segment(cur_at[s], n, like_cur), ranks[a:a + n]
            lo, hi = _minmax_kernel(c) if n else (0, 0)
            ok = 0 <= lo and hi < B  # encode_codes's range check
            if delta[s] and ok and n:
                p = segment(prev_at[s], n, like_prev)
                lo, hi = _minmax_kernel(p)
                ok = 0 <= lo and hi < B
                for i in range(n):  # D = (prev - cur) mod B; widened first: numba's uint8 - uint8 wraps
                    d = np.int64(p[i]) - np.int64(c[i])
                    r[i] = d + B if d < 0 else d
                lo, hi = _minmax_kernel(r)
                k, rows[s] = _alphabet(r, lo, hi, r, True, vals[vo[s]:], freqs[vo[s]:]) if ok else (-1, 0)
            else:
                k, rows[s] = _alphabet(c, lo, hi, r, False, vals[vo[s]:], freqs[vo[s]:]) if ok else (-1, 0)
            if k < 0:
                status[s] = 1
                continue
            ks[s], Ps[s] = k, min(PRECISION_BITS, max(8, 64 - _leading_zeros(n)))
            if k >= 2:
                counts = freqs[vo[s]:vo[s] + k].copy()
                if not _round_counts(counts, Ps[s], freqs[vo[s]:vo[s] + k]):
                    status[s] = 1
                    continue
                cost = _cost_kernel(counts, freqs[vo[s]:vo[s] + k], Ps[s])
                lanes[s] = 4 if cost >= _LANE_BITS[0] else 2 if cost >= _LANE_BITS[1] else 1  # choose_lanes
                grow = (cost + n * _GROWTH_SLACK * 2.0 ** (Ps[s] - 31)) / 32 * (1 + 1e-9)
                caps[s] = np.int64(math.ceil(grow)) + 2 + 3 * lanes[s]  # rans_encode's cap + 2 lanes
            vo[s + 1] = vo[s] + k

    @_numba.njit(cache=True, nogil=True)
    def _streams_kernel(offsets, ranks, vals, freqs, vo, ks, Ps, lanes, rows, words, ends, out, at,
                        status):  # pragma: no cover - compiled
        """rans_encode_codes's words (segment s pushes down from ends[s], at most caps[s]; the
        single-lane streams four at a time, the two-lane ones two at a time, each group of similar
        lengths: one lane's states form a chain of dependent multiplies, four chains keep the core
        busy), then each stream's bytes (without the CRC) at out[at[s]:at[s+1]]."""
        S = offsets.size - 1
        first = np.zeros(S, np.int64)
        single = np.empty(S + 3, np.int64)
        double = np.empty(S + 1, np.int64)
        n1 = n2 = 0
        for s in range(S):
            if status[s] or ks[s] < 2:
                continue
            if lanes[s] == 1:
                single[n1] = s
                n1 += 1
                continue
            if lanes[s] == 2:
                double[n2] = s
                n2 += 1
                continue
            w0 = ends[s - 1] if s else 0
            got = _encode_kernel(ranks[offsets[s]:offsets[s + 1]], 0, None,
                                 _stream(s, offsets, vals, freqs, vo, ks, Ps, rows, ends, S)[0], lanes[s],
                                 words[w0:ends[s]])
            if got < 0:  # past the bound (it holds: never seen)
                status[s] = 1
            first[s] = w0 + got
        # streams of similar length side by side: a group runs as long as its longest stream
        sizes = offsets[1:] - offsets[:-1]
        single[:n1] = single[:n1][np.argsort(sizes[single[:n1]], kind="mergesort")]
        double[:n2] = double[:n2][np.argsort(sizes[double[:n2]], kind="mergesort")]
        for j in range(n1, n1 + 3):
            single[j] = S  # no stream
        double[n2] = S
        for j in range(0, n1, 4):
            _encode_four(single[j:j + 4], offsets, ranks, vals, freqs, vo, ks, Ps, rows, words, ends, first, status, S)
        for j in range(0, n2, 2):
            _encode_two_pairs(double[j], double[j + 1], offsets, ranks, vals, freqs, vo, ks, Ps, rows, words, ends,
                              first, status, S)
        pos = 0
        for s in range(S):  # the bytes
            at[s] = pos
            if status[s]:
                at[s + 1] = pos
                continue
            n, k, v = offsets[s + 1] - offsets[s], ks[s], vo[s]
            for b in _MAGIC_BYTES:  # alphabet_header
                out[pos] = b
                pos += 1
            pos = _put_varint(out, pos, n)
            pos = _put_varint(out, pos, k)
            if k:
                pos = _put_varint(out, pos, 2 * vals[v])  # zigzag of a value >= 0
                for j in range(1, k):
                    pos = _put_varint(out, pos, vals[v + j] - vals[v + j - 1] - 1)
            if k >= 2:
                for j in range(k):
                    pos = _put_varint(out, pos, freqs[v + j])
                out[pos] = lanes[s]
                pos = _put_varint(out, pos + 1, ends[s] - first[s])
                for j in range(first[s], ends[s]):
                    w = words[j]
                    out[pos] = w & 0xFF
                    out[pos + 1] = (w >> 8) & 0xFF
                    out[pos + 2] = (w >> 16) & 0xFF
                    out[pos + 3] = w >> 24
                    pos += 4
            at[s + 1] = pos
        return pos

    @_numba.njit(cache=True, nogil=True)
    def _alphabet(sym, lo, hi, ranks, in_place, vals, counts):  # pragma: no cover - compiled
        """sym's distinct values (in [lo, hi]) into vals and their counts, each symbol into ranks
        (``in_place``: ranks is sym) -> (k, rows): where the span is at most _VALUE_ROWS, rows is
        the span and the symbol is its value less lo, else rows is 0 and the symbol its rank among
        the values. k is -1 where rans_encode takes its general path (a sparse alphabet, too many
        distinct values)."""
        n = sym.size
        if n and hi - lo >= max(1 << 22, 2 * n):
            return -1, 0
        span = hi - lo + 1 if n else 0
        cnt = np.zeros(span, dtype=np.int64)
        _count_kernel(sym, lo, cnt)
        lut = np.zeros(span, dtype=np.int64)
        k = 0
        for v in range(span):
            if cnt[v]:
                if k == _MAX_DISTINCT:
                    return -1, 0
                vals[k], counts[k], lut[v] = v + lo, cnt[v], k
                k += 1
        if span <= _VALUE_ROWS:
            if lo or not in_place:
                for i in range(np.uint64(n)):  # vectorizes (the lookup below does not)
                    ranks[i] = sym[i] - lo
            return k, span
        for i in range(n):
            ranks[i] = lut[sym[i] - lo]
        return k, 0

    @_numba.njit(cache=True, nogil=True)
    def _encode_four(group, offsets, ranks, vals, freqs, vo, ks, Ps, rows, words, ends, first, status,
                     none):  # pragma: no cover - compiled
        """Four single-lane streams at once (segments ``group``; ``none``: no stream), each pushing
        its words down from ends[s] as _encode_kernel(lanes=1) does; first[s] = its first word. A
        stream that would pass its region's start (rans_encode's bound holds: never seen) stops
        and is left to rans_encode (status)."""
        s0, s1, s2, s3 = group[0], group[1], group[2], group[3]
        t0, n0, a0, p0, l0 = _stream(s0, offsets, vals, freqs, vo, ks, Ps, rows, ends, none)
        t1, n1, a1, p1, l1 = _stream(s1, offsets, vals, freqs, vo, ks, Ps, rows, ends, none)
        t2, n2, a2, p2, l2 = _stream(s2, offsets, vals, freqs, vo, ks, Ps, rows, ends, none)
        t3, n3, a3, p3, l3 = _stream(s3, offsets, vals, freqs, vo, ks, Ps, rows, ends, none)
        x0 = x1 = x2 = x3 = _UL
        i = max(max(n0, n1), max(n2, n3)) - 1
        common = min(min(n0, n1), min(n2, n3))
        while i >= 0:
            m = min(i + 1, 64)
            if i < common and min(min(p0 - l0, p1 - l1), min(p2 - l2, p3 - l3)) > m:
                # all four streams, room for a word a symbol: no tests per symbol, unsigned indices
                b0, b1, b2, b3 = np.uint64(a0 + i), np.uint64(a1 + i), np.uint64(a2 + i), np.uint64(a3 + i)
                q0, q1, q2, q3 = np.uint64(p0), np.uint64(p1), np.uint64(p2), np.uint64(p3)
                for u in range(np.uint64(m)):
                    x0, q0 = _push_u(x0, t0, ranks[b0 - u], words, q0)
                    x1, q1 = _push_u(x1, t1, ranks[b1 - u], words, q1)
                    x2, q2 = _push_u(x2, t2, ranks[b2 - u], words, q2)
                    x3, q3 = _push_u(x3, t3, ranks[b3 - u], words, q3)
                p0, p1, p2, p3 = np.int64(q0), np.int64(q1), np.int64(q2), np.int64(q3)
                i -= m
                continue
            if i < n0 and p0 > l0:
                x0, p0 = _push(x0, t0, ranks[a0 + i], words, p0)
            if i < n1 and p1 > l1:
                x1, p1 = _push(x1, t1, ranks[a1 + i], words, p1)
            if i < n2 and p2 > l2:
                x2, p2 = _push(x2, t2, ranks[a2 + i], words, p2)
            if i < n3 and p3 > l3:
                x3, p3 = _push(x3, t3, ranks[a3 + i], words, p3)
            i -= 1
        _flush_one(s0, x0, p0 if p0 > l0 else l0, l0, words, first, status, none)
        _flush_one(s1, x1, p1 if p1 > l1 else l1, l1, words, first, status, none)
        _flush_one(s2, x2, p2 if p2 > l2 else l2, l2, words, first, status, none)
        _flush_one(s3, x3, p3 if p3 > l3 else l3, l3, words, first, status, none)

    @_numba.njit(cache=True, nogil=True)
    def _encode_two_pairs(sa, sb, offsets, ranks, vals, freqs, vo, ks, Ps, rows, words, ends, first, status,
                          none):  # pragma: no cover - compiled
        """Two two-lane streams at once (segment sb may be ``none``), each written as
        _encode_kernel(lanes=2) writes it: lane i mod 2 takes symbol i, backwards from the last,
        the lanes sharing one word position; first[s] = its first word."""
        ta, na, aa, pa, la = _stream(sa, offsets, vals, freqs, vo, ks, Ps, rows, ends, none)
        tb, nb, ab, pb, lb = _stream(sb, offsets, vals, freqs, vo, ks, Ps, rows, ends, none)
        xa0 = xa1 = xb0 = xb1 = _UL
        if na % 2:  # an odd count: the last symbol is lane 0's alone
            xa0, pa = _push(xa0, ta, ranks[aa + na - 1], words, pa)
        if nb % 2:
            xb0, pb = _push(xb0, tb, ranks[ab + nb - 1], words, pb)
        ga, gb = na // 2, nb // 2  # whole pairs
        oka, okb = True, True
        g = max(ga, gb) - 1
        while g >= 0:
            m = min(g + 1, 64)
            if g < min(ga, gb) and min(pa - la, pb - lb) > 2 * m + 4:  # as _encode_four
                ua, ub = np.uint64(aa + 2 * g), np.uint64(ab + 2 * g)
                qa, qb = np.uint64(pa), np.uint64(pb)
                for u in range(np.uint64(0), np.uint64(2 * m), np.uint64(2)):
                    xa1, qa = _push_u(xa1, ta, ranks[ua - u + np.uint64(1)], words, qa)
                    xa0, qa = _push_u(xa0, ta, ranks[ua - u], words, qa)
                    xb1, qb = _push_u(xb1, tb, ranks[ub - u + np.uint64(1)], words, qb)
                    xb0, qb = _push_u(xb0, tb, ranks[ub - u], words, qb)
                pa, pb = np.int64(qa), np.int64(qb)
                g -= m
                continue
            if g < ga and oka:
                oka = pa - la > 6
                if oka:
                    xa1, pa = _push(xa1, ta, ranks[aa + 2 * g + 1], words, pa)
                    xa0, pa = _push(xa0, ta, ranks[aa + 2 * g], words, pa)
            if g < gb and okb:
                okb = pb - lb > 6
                if okb:
                    xb1, pb = _push(xb1, tb, ranks[ab + 2 * g + 1], words, pb)
                    xb0, pb = _push(xb0, tb, ranks[ab + 2 * g], words, pb)
            g -= 1
        _flush_two(sa, xa0, xa1, pa, oka, words, first, status, none)
        _flush_two(sb, xb0, xb1, pb, okb, words, first, status, none)

    @_numba.njit(inline="always")
    def _flush_two(s, x0, x1, p, ok, words, first, status, none):  # pragma: no cover - compiled
        """Two lanes' final states in front of their words, lane 0 first, high word first."""
        if s != none:
            if not ok:  # past the bound (it holds: never seen)
                status[s] = 1
            else:
                words[p - 4] = np.uint32(x0 >> _U32)
                words[p - 3] = np.uint32(x0 & _LO)
                words[p - 2] = np.uint32(x1 >> _U32)
                words[p - 1] = np.uint32(x1 & _LO)
                first[s] = p - 4

    @_numba.njit(cache=True, nogil=True)
    def _stream(s, offsets, vals, freqs, vo, ks, Ps, rows, ends, none):  # pragma: no cover - compiled
        """(encode table by symbol, symbol count, first symbol, words end, words start) of segment
        s; no symbols and no words for ``none``."""
        if s == none:
            return _encode_tables(np.ones(2, np.uint64), 1), 0, 0, 0, 0
        t = _encode_tables(freqs[vo[s]:vo[s + 1]].astype(np.uint64), Ps[s])
        if rows[s]:  # a row per value in the span (absent values' rows are never read)
            by_value = np.zeros(4 * rows[s], np.uint64)
            rank = _rank_of(s, vals, vo, ks, rows)
            for v in range(rows[s]):
                if rank[v] >= 0:
                    by_value[4 * v:4 * v + 4] = t[4 * rank[v]:4 * rank[v] + 4]
            t = by_value
        return t, offsets[s + 1] - offsets[s], offsets[s], ends[s], ends[s - 1] if s else 0

    @_numba.njit(cache=True, nogil=True)
    def _rank_of(s, vals, vo, ks, rows):  # pragma: no cover - compiled
        """Segment s's rank of each of its symbols (-1: absent): of each value in the span where
        rows[s] > 0, else of each rank."""
        if not rows[s]:
            return np.arange(ks[s]).astype(np.int32)
        rank = np.full(rows[s], -1, np.int32)
        for j in range(ks[s]):
            rank[vals[vo[s] + j] - vals[vo[s]]] = j
        return rank

    @_numba.njit(inline="always")
    def _flush_one(s, x, p, lo, words, first, status, none):  # pragma: no cover - compiled
        """A single lane's final state in front of its words, high word first (if it has room)."""
        if s != none:
            if p - 2 < lo:
                status[s] = 1
            else:
                words[p - 2] = np.uint32(x >> _U32)
                words[p - 1] = np.uint32(x & _LO)
                first[s] = p - 2

    @_numba.njit(inline="always")
    def _leading_zeros(n):  # pragma: no cover - compiled
        z = 64
        while n:
            n >>= 1
            z -= 1
        return z
else:  # pragma: no cover
    _round_counts = _encode_kernel = _decode_kernel = _decode4_kernel = _cost_kernel = _alphabets_kernel = None
    _streams_kernel = None
