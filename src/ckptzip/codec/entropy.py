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

Every coder buffer is framed the same way (codec/streamframe.py): a 3-byte magic, the coder's
fields as varints, its payload, a CRC-32 checked before anything is sized from a header field.

The code pipeline (quantization-aware delta, Inshrinkerator §6)::

    buf  = encode_codes(prev_codes, cur_codes, n_levels, rearrange=True, rle=True, coder="huffman")
    cur  = decode_codes(buf, prev_codes)            # prev_codes=None for a keyframe

    keyframe (prev is None):   codes --------------------------------> [pack | RLE] -> coder
    delta:                     D = (prev - cur) mod B -> [rearrange] -> [pack | RLE] -> coder

``pack`` (``tuples=True``, never with RLE): the stream's codes ``tuples.size(B)`` to a symbol.

``encode_codes`` buffer, byte by byte::

    b"CQ" 0x01            magic + version
    flags (u8)            bit 0 delta, bit 1 rearranged, bit 2 RLE, bit 3 packed (tuples.py),
                          bits 4-7 coder id (0 huffman, 1 ans, 2 zstd, 3 rans)
    n (varint)            number of codes
    n_levels (varint)     B of the cyclic delta (codes lie in [0, B))
    crc32 (u32 LE)        of the bytes above
    coder buffer          the rest: the coder's own framed bytes (with its own CRC)

The reader needs nothing but ``prev_codes`` (for a delta). The runs of the RLE stage cross the
group boundaries of the rearrangement: never longer than per-group runs, decoded identically.
"""
from __future__ import annotations

import functools
import importlib
import struct
import zlib
from collections.abc import Sequence
from typing import Callable

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..tensorbytes import INT_DTYPES, numpy_dtype, to_numpy_bits
from . import delta as _delta
from . import rle as _rle
from . import tuples as _tuples
from .frames import zstd_compress, zstd_decompress
from .streamframe import ByteReader, as_symbols, seal, unseal, write_varint

__all__ = [
    "CODERS", "get_coder", "encode_stream", "decode_stream", "zstd_encode", "zstd_decode",
    "encode_codes", "encode_codes_many", "decode_codes", "read_codes_header", "entropy_bits", "conditional_bits",
]

# name -> (module, encode function, decode function); resolved on first use (numba compiles on import)
CODERS: dict[str, tuple[str, str, str]] = {
    "huffman": ("ckptzip.codec.huffman", "huffman_encode", "huffman_decode"),
    "ans": ("ckptzip.codec.ans", "ans_encode", "ans_decode"),
    "zstd": ("ckptzip.codec.entropy", "zstd_encode", "zstd_decode"),
    "rans": ("ckptzip.codec.rans", "rans_encode", "rans_decode"),
}
_CODER_IDS = {"huffman": 0, "ans": 1, "zstd": 2, "rans": 3}   # stored in the codes header; never renumber
_CODER_NAMES = {v: k for k, v in _CODER_IDS.items()}

_CODES_MAGIC = b"CQ\x01"
_F_DELTA, _F_REARRANGE, _F_RLE, _F_TUPLES = 1, 2, 4, 8
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
                 rearrange: bool = True, rle: bool = True, coder: str = "huffman", tuples: bool = False) -> bytes:
    """Encode the integer codes of one tensor, against the previous checkpoint's codes if given.

    ``n_levels``: B, the cyclic buffer size; pass max(levels of prev, levels of cur). Codes may
    be of any integer dtype (narrow codes are not widened: same bytes) and live on any device;
    the delta, rearrangement and RLE run there, the entropy coder on CPU.
    ``rearrange`` is ignored for a keyframe (there is no source bucket to group by).
    ``tuples``: the stream packed ``tuples.size(B)`` codes to a symbol (B of 2 to 32, without RLE).
    """
    if coder not in _CODER_IDS:
        raise ValueError(f"unknown coder {coder!r}; choose one of {sorted(_CODER_IDS)}")
    if tuples and (rle or _tuples.size(int(n_levels)) < 2):
        raise ValueError(f"tuples=True packs the codes of 2 to 32 levels without RLE, got n_levels={n_levels}, "
                         f"rle={rle}")
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
    if tuples:
        stream = _tuples.pack(stream, int(n_levels))
        flags |= _F_TUPLES
    return _codes_header(flags | _CODER_IDS[coder] << 4, cur.numel(), n_levels) + encode_stream(coder, stream)


@functools.lru_cache(maxsize=4096)
def _codes_header(flags: int, n: int, n_levels: int) -> bytes:
    """The sealed ``encode_codes`` header (module docstring) before the coder's buffer (a record's
    is the same at every save: built once)."""
    head = bytearray(_CODES_MAGIC)
    head.append(flags)
    write_varint(head, n)
    write_varint(head, int(n_levels))
    return seal(head)


def encode_codes_many(jobs: Sequence[tuple[torch.Tensor | None, torch.Tensor, int, dict]]) -> list[bytes]:
    """``[encode_codes(prev, cur, n_levels, **options) for prev, cur, n_levels, options in jobs]``, the
    same bytes; the order-0 rANS streams among them (coder ``"rans"`` without RLE or a rearranged
    delta: what ``coder="auto"`` picks for most tensors) coded a batch of up to BATCH_CODES codes of
    one code dtype per kernel call (``rans.rans_encode_codes``, which reads them in place) instead
    of one Python pipeline per tensor; a larger tensor is a batch of its own. Packed streams
    (``tuples``) are packed here, a delta taken on the way, and batched as plain symbols."""
    from . import rans

    out: list[bytes | None] = [None] * len(jobs)
    kinds: dict[tuple, list[list[int]]] = {}
    filled: dict[tuple, int] = {}  # symbols in each kind's last batch
    for i, (prev, cur, n_levels, options) in enumerate(jobs):
        if not (_batchable(prev, cur, n_levels, options) and rans.HAVE_NUMBA):
            continue
        # a kind is a kernel call's symbols' numpy dtype and its prevs' (one dtype each): packed
        # symbols and plain uint8 codes without a delta share one call
        if options.get("tuples", False):  # packed with the batch, a delta taken on the way: plain symbols
            kind, size = (_tuples.symbol_dtype(int(n_levels)), None), -(-cur.numel() // _tuples.size(int(n_levels)))
        else:
            kind, size = (numpy_dtype(cur.dtype), None if prev is None else prev.dtype), cur.numel()
        batches = kinds.setdefault(kind, [[]])
        if batches[-1] and filled[kind] + size > BATCH_CODES:
            batches.append([])
            filled[kind] = 0
        batches[-1].append(i)
        filled[kind] = filled.get(kind, 0) + size
    for (_, prev_dtype), members in ((k, m) for k, batches in kinds.items() for m in batches):
        syms, levels, coded = [], [], []
        packed = _pack_batch(jobs, [i for i in members if jobs[i][3].get("tuples", False)])
        for i in members:  # packed here, one batch at a time: a save holds one batch's symbols
            prev, cur, B, options = jobs[i]
            if options.get("tuples", False):
                if packed[i] is None:  # a code outside [0, B): encode_codes below says so
                    continue
                syms.append(packed[i])
                levels.append(B ** _tuples.size(B))
            else:
                syms.append(to_numpy_bits(cur))  # a view of the usual flat CPU codes
                levels.append(B)
            coded.append(i)
        prevs = [] if prev_dtype is None else [to_numpy_bits(jobs[i][0]) for i in coded]
        streams = rans.rans_encode_codes(syms, levels, prevs, np.full(len(coded), bool(prevs))) if coded else []
        for i, stream in zip(coded, streams):
            if stream is not None:  # else: encode_codes below says what is wrong, or takes the general path
                flags = (_F_DELTA if jobs[i][0] is not None else 0) | _CODER_IDS["rans"] << 4 | \
                    (_F_TUPLES if jobs[i][3].get("tuples", False) else 0)
                out[i] = _codes_header(flags, jobs[i][1].numel(), jobs[i][2]) + stream
    return [b if b is not None else encode_codes(prev, cur, n_levels, **options)
            for b, (prev, cur, n_levels, options) in zip(out, jobs)]


BATCH_CODES = 1 << 22  # codes per batch of encode_codes_many: its scratch (a rank per code) stays small


def _pack_batch(jobs, members: list[int]) -> dict[int, np.ndarray | None]:
    """Job -> its packed symbols (``tuples.pack``, a delta taken on the way), None where pack
    refuses: one ``tuples.pack_many`` call where the codes (and the prevs) share a dtype, else
    one pack a stream."""
    curs = [np.ascontiguousarray(to_numpy_bits(jobs[i][1])) for i in members]
    prevs = [None if jobs[i][0] is None else np.ascontiguousarray(to_numpy_bits(jobs[i][0])) for i in members]
    if len({c.dtype for c in curs}) <= 1 and len({p.dtype for p in prevs if p is not None}) <= 1:
        return dict(zip(members, _tuples.pack_many(curs, [int(jobs[i][2]) for i in members], prevs)))
    out = {}
    for i, c, p in zip(members, curs, prevs):
        try:
            out[i] = _tuples.pack(c, int(jobs[i][2]), prev=p)
        except ValueError:
            out[i] = None
    return out


def _batchable(prev, cur, n_levels, options) -> bool:
    """Whether encode_codes of this job is the plain order-0 rANS stream of valid-looking codes."""
    if options.get("coder", "huffman") != "rans" or options.get("rle", True):
        return False
    if options.get("tuples", False) and not (isinstance(n_levels, (int, np.integer))
                                             and _tuples.size(int(n_levels)) > 1):
        return False  # encode_codes refuses
    if prev is not None and (options.get("rearrange", True) or not isinstance(prev, torch.Tensor)
                             or prev.dtype not in INT_DTYPES or prev.numel() != cur.numel()):
        return False
    return isinstance(cur, torch.Tensor) and cur.dtype in INT_DTYPES and isinstance(n_levels, (int, np.integer)) \
        and 1 <= n_levels < 1 << 62


def read_codes_header(buf) -> dict:
    """The header fields of an ``encode_codes`` buffer (without decoding the stream)."""
    h, _ = _split_codes(buf)
    return h


def decode_codes(buf, prev_codes: torch.Tensor | None = None, n_levels: int | None = None, *,
                 device: torch.device | str | None = None, symbols: np.ndarray | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_codes` -> (n,) codes: int64, or uint8 where they fit (always from a
    packed stream, tuple/1; from an order-0 rANS stream of values up to 255 and from a plain delta
    of at most 256 levels on the CPU).

    ``prev_codes``: the previous checkpoint's codes, required exactly when the buffer is a delta.
    ``n_levels``: optional check against the recorded B. The result lives on ``device``, else on
    ``prev_codes``'s device, else on CPU. ``symbols``: the buffer's stream already decoded
    (:func:`decode_symbols_many`).
    """
    h, body = _split_codes(buf)
    n, levels = h["n"], h["n_levels"]
    if n_levels is not None and int(n_levels) != levels:
        raise ValueError(f"the buffer was encoded with n_levels={levels}, caller expects {n_levels}")
    if h["delta"] and prev_codes is None:
        raise ValueError("this buffer is a delta: pass the previous checkpoint's codes as prev_codes")
    if device is None:
        device = prev_codes.device if prev_codes is not None else "cpu"
    if symbols is None and h["coder"] == "rans" and not h["rle"]:
        from .rans import rans_decode  # codes of at most 256 values as uint8: 1 fresh byte a code, not 8

        symbols = rans_decode(body, narrow=True)
    elif symbols is None:
        symbols = decode_stream(h["coder"], body)
    stream = torch.from_numpy(symbols).to(device)
    prev = None
    if h["delta"]:
        prev = _delta._flat_codes(prev_codes, "prev_codes").to(device)
        if prev.numel() != n:
            raise ValueError(f"prev_codes has {prev.numel()} codes but the delta was taken over {n}; "
                             "pass the codes of the checkpoint this delta was encoded against")
    if h["tuples"]:  # every code in [0, levels), or it raised; a plain delta undone on the way
        fused = h["delta"] and not h["rearrange"]
        stream = _tuples.unpack(stream, n, levels, prev=prev if fused else None)
        if fused or not h["delta"]:
            return stream
    elif h["rle"]:
        stream = _rle.rle_decode(stream, n)
    elif stream.numel() != n:
        raise CorruptCheckpointError(f"code stream holds {stream.numel()} symbols, header says {n}")
    if not h["tuples"] and h["delta"] and not h["rearrange"] and stream.numel() == n:
        got = _delta.undo_in_range(prev, stream, levels)  # both range-checked in the pass
        if got is not None:
            return got
    if not h["tuples"]:
        lo, hi = (int(v) for v in torch.aminmax(stream)) if n else (0, 0)
        if lo < 0 or hi >= levels:
            raise CorruptCheckpointError(f"decoded codes fall outside [0, {levels})")
    if not h["delta"]:
        return stream
    if h["rearrange"]:  # range-checks prev while counting its groups
        return _delta.undo_grouped_cyclic_delta(prev, stream, levels).to(torch.int64)
    _delta._check_range(prev, levels, "prev_codes")
    return _delta.undo_cyclic_delta(prev, stream, levels).to(torch.int64)


def decode_symbols_many(bufs: Sequence, max_symbols: int) -> list[np.ndarray | None]:
    """The streams of many :func:`encode_codes` buffers decoded ahead of ``decode_codes(buf,
    symbols=)``: the order-0 rANS ones (no RLE), in order while they hold at most ``max_symbols``
    codes in all, in one batch (``rans_decode_many``: single-lane streams four at a time); None for
    the rest, and for every buffer where one is damaged (decode_codes reports it as before)."""
    from .rans import rans_decode_many

    picked, bodies, total = [], [], 0
    try:
        for i, buf in enumerate(bufs):
            h, body = _split_codes(buf)
            if h["coder"] == "rans" and not h["rle"] and total + h["n"] <= max_symbols:
                picked.append(i)
                bodies.append(body)
                total += h["n"]
        decoded = rans_decode_many(bodies)
    except CorruptCheckpointError:
        return [None] * len(bufs)
    out: list[np.ndarray | None] = [None] * len(bufs)
    for i, symbols in zip(picked, decoded):
        out[i] = symbols
    return out


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
    packed = flags & _F_TUPLES and (flags & _F_RLE or _tuples.size(levels) < 2)
    if coder_id not in _CODER_NAMES or packed or levels < 1:
        raise CorruptCheckpointError(f"code buffer header has invalid flags {flags:#x} or n_levels {levels}")
    return ({"n": n, "n_levels": levels, "delta": bool(flags & _F_DELTA),
             "rearrange": bool(flags & _F_REARRANGE), "rle": bool(flags & _F_RLE), "tuples": bool(flags & _F_TUPLES),
             "coder": _CODER_NAMES[coder_id]}, r.rest())


# =========================================================================== estimates
def entropy_bits(symbols) -> float:
    """Order-0 entropy of a stream in bits (n * H(p) of its empirical distribution); torch."""
    t = symbols if isinstance(symbols, torch.Tensor) else torch.as_tensor(np.asarray(symbols))
    t = t.reshape(-1)
    if t.numel() == 0:
        return 0.0
    lo, hi = (int(v) for v in torch.aminmax(t))
    if _count_kernel is not None and t.device.type == "cpu" and t.dtype in INT_DTYPES and hi - lo < 1 << 16:
        counts = np.zeros(hi - lo + 1, dtype=np.int64)  # bincount's counts, without its int64 copy
        _count_kernel(t.contiguous().numpy(), lo, counts)
        counts = torch.from_numpy(counts)
    elif hi - lo < max(1 << 22, 2 * t.numel()):
        counts = torch.bincount((t.to(torch.int64) - lo))
    else:  # sparse alphabet: a sort is cheaper than a huge count table
        counts = torch.unique(t, return_counts=True)[1]
    return _bits(counts, t.numel())


def _bits(counts: torch.Tensor, n: int) -> float:
    """n * H of the counts of n symbols, in value order (zeros ignored)."""
    counts = counts[counts > 0].to(torch.float64)
    return float(-(counts * torch.log2(counts / float(n))).sum())


def conditional_bits(prev: torch.Tensor, cur: torch.Tensor, n_levels: int) -> float:
    """n * H(cur | prev) of two code tensors of n codes in [0, n_levels): the search's estimate of a
    delta, ``entropy_bits(prev * B + (cur - prev) mod B) - entropy_bits(prev)`` (the reference), with
    the counts from one numba pass over narrow codes instead of four int64 torch passes: the same
    counts in the same order, so the same floats."""
    prev, cur = prev.reshape(-1), cur.reshape(-1)
    B, n = int(n_levels), cur.numel()
    if not (_numba_counts is not None and n and B <= 1 << 11 and prev.device.type == cur.device.type == "cpu"
            and prev.dtype in INT_DTYPES and cur.dtype in INT_DTYPES):
        delta = torch.remainder(cur.long() - prev.long(), B)
        return entropy_bits(prev.long() * B + delta) - entropy_bits(prev)
    joint, marginal = np.zeros(B * B, dtype=np.int64), np.zeros(B, dtype=np.int64)
    if not _numba_counts(prev.numpy(), cur.numpy(), B, joint, marginal):
        raise ValueError(f"codes outside [0, {B}): pass n_levels = max of both checkpoints' level counts")
    return _bits(torch.from_numpy(joint), n) - _bits(torch.from_numpy(marginal), n)


try:
    import numba as _nb

    @_nb.njit(cache=True, nogil=True)
    def _numba_counts(prev, cur, B, joint, marginal):  # pragma: no cover - compiled
        """joint[p * B + (c - p) mod B] and marginal[p] counts -> False on a code outside [0, B)."""
        for i in range(cur.shape[0]):
            p = np.int64(prev[i])  # widened first: numba's uint8 arithmetic wraps
            c = np.int64(cur[i])
            if p < 0 or p >= B or c < 0 or c >= B:
                return False
            d = c - p
            joint[p * B + (d + B if d < 0 else d)] += 1
            marginal[p] += 1
        return True

    from .streamframe import _count_kernel  # counts[v - lo] += 1, the coders' own count pass
except ImportError:  # pragma: no cover
    _numba_counts = _count_kernel = None
