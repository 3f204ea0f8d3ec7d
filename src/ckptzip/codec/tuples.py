"""Codes of a small alphabet coded a few to a symbol (stage ``tuple/1``).

An order-0 coder spends one state update per symbol whatever the symbol's cost: the 3-level
direction codes of Adam's ``exp_avg`` (90 % of them one level, 0.57 bits each) took as long per
code as 5-bit weight deltas. Packed ``g`` to a symbol, a stream of ``n`` codes in ``[0, B)`` is
``ceil(n / g)`` symbols in ``[0, B**g)``, the first code of each group the lowest digit and the
last group padded with code 0::

    T[j] = S[g*j] + B * S[g*j + 1] + ... + B**(g-1) * S[g*j + g - 1]

``g = size(B)``: 5, 3, 2, 2 for B = 2..5 (``B**g <= 32``), 2 for B = 6..32 (a cyclic delta's
few distinct pairs), else 1 (not packed). Order-0 over the groups costs what order-0 over the
codes does, less the codes' dependence within a group, plus a larger alphabet table in the
coder's header (tens of bytes): the writer packs a stream only from ``min_codes(B)`` codes
(docs/BENCHMARKS.md, "Code streams a few codes to a symbol").

    syms = pack(codes, B)               # -> numpy, ceil(n / g) symbols (uint8, or uint16 past 256)
    syms = pack(codes, B, prev=parent)  # the cyclic delta (parent - codes) mod B, packed
    syms = pack_many([codes, ...], [B, ...], [parent or None, ...])  # many streams, one kernel call
    codes = unpack(syms, n, B)          # -> uint8 torch (B <= 32); CorruptCheckpointError on a bad symbol
    codes = unpack(syms, n, B, prev=parent)  # the delta undone in the same pass

Both have a plain torch reference (``backend="torch"``); numba kernels give the same result on CPU.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from . import delta as _delta
from .rle import _use_numba  # the codec's backend check: "auto", "numba" (CPU only) or "torch"

try:  # optional fast path
    import numba as _numba

    from ..inplace import segment
    from .delta import _delta_kernel
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["size", "symbol_dtype", "min_codes", "pack", "pack_many", "unpack"]

MAX_PAIRED = 32        # the largest B packed (in pairs: 1024 symbols, the rANS kernels' table of values)
SMALL_CODES = 4096     # B <= 5: below it the alphabet table (up to 32 entries) costs more than packing saves
PAIRED_CODES = 1 << 17  # B = 6..32: ~100 bytes more table a stream, paid back only by long streams
# B = 6..32 where the codes are a delta of grid levels (Adam's exp_avg_sq): mostly -1, 0 and +1, so
# at most ~9 pairs in the table; from here it costs under 1 % of the stream and halves its symbols
STEP_PAIRED_CODES = 1 << 14


def size(B: int) -> int:
    """Codes per symbol for an alphabet of ``B`` codes (1: never packed)."""
    if B < 2 or B > MAX_PAIRED:
        return 1
    g = 1
    while B ** (g + 1) <= 32:
        g += 1
    return max(g, 2)


def symbol_dtype(B: int) -> np.dtype:
    """The symbols' dtype for an alphabet of ``B`` codes (uint8, or uint16 past 256 symbols)."""
    return np.dtype(np.uint8 if B ** size(B) <= 256 else np.uint16)


def min_codes(B: int, *, steps: bool = False) -> int:
    """The writer's floor: a stream of fewer codes is not packed (``steps``: the codes are a cyclic
    delta of levels that move by a step or two, few pairs)."""
    return SMALL_CODES if B <= 5 else STEP_PAIRED_CODES if steps else PAIRED_CODES


def pack(codes, B: int, *, prev=None, backend: str = "auto") -> np.ndarray:
    """Flat codes in ``[0, B)`` (numpy or torch, any integer dtype), or their cyclic delta
    ``(prev - codes) mod B`` against ``prev`` (as many codes in [0, B)) -> the symbols (module
    docstring), uint8 or uint16. A code outside [0, B) is a ValueError."""
    g = size(B)
    if g < 2:
        raise ValueError(f"an alphabet of {B} codes is not packed (tuples.size({B}) == 1)")
    c = torch.as_tensor(codes).reshape(-1)  # numpy: a view
    p = None if prev is None else torch.as_tensor(prev).reshape(-1)
    n = c.numel()
    if p is not None and p.numel() != n:
        raise ValueError(f"a delta needs prev of the codes' size {n}")
    if _use_numba(backend, c) and (p is None or _use_numba(backend, p)):
        x = c.numpy()
        if p is not None:
            x = np.empty(n, dtype=np.uint8)  # B <= 32
            if not _delta._delta_kernel(p.numpy(), c.numpy(), B, x):
                raise ValueError(f"codes outside [0, {B}) cannot be packed")
        out = np.empty(-(-n // g), dtype=symbol_dtype(B))
        if not _pack_kernel(x, B, g, out):
            raise ValueError(f"codes outside [0, {B}) cannot be packed")
        return out
    c = c.to(torch.int64)
    p = None if p is None else p.to(torch.int64)
    for t in (c,) if p is None else (c, p):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= B):
            raise ValueError(f"codes outside [0, {B}) cannot be packed")
    if p is not None:
        c = torch.remainder(p - c, B)
    c = torch.cat([c, c.new_zeros(-c.numel() % g)]).view(-1, g)
    weights = B ** torch.arange(g, dtype=torch.int64, device=c.device)
    return (c * weights).sum(1).cpu().numpy().astype(symbol_dtype(B))


def pack_many(codes: list[np.ndarray], Bs: list[int], prevs: list[np.ndarray | None]) -> list[np.ndarray | None]:
    """``[pack(c, B, prev=p) for c, B, p in zip(codes, Bs, prevs)]`` in one kernel call (numba only):
    C-contiguous 1-D numpy codes of one dtype, the prevs (None: no delta) of one dtype, every B's
    symbols of one ``symbol_dtype``; each result a view of one buffer. None where ``pack`` raises
    (a code outside [0, B)). A save packs ~30 streams: ~15 us of Python each one at a time."""
    from ..inplace import addresses

    S = len(codes)
    gs = np.array([size(B) for B in Bs], dtype=np.int64)
    if S == 0:
        return []
    if (gs < 2).any() or len({symbol_dtype(B) for B in Bs}) != 1:
        raise ValueError("pack_many packs alphabets of one symbol dtype, each packed (tuples.size(B) > 1)")
    cur_at, offsets = addresses(codes, codes[0].dtype)
    has = [p is not None for p in prevs]
    given = [p for p in prevs if p is not None]
    if [p.size for p in given] != [c.size for c, h in zip(codes, has) if h]:
        raise ValueError("a delta needs prev of the codes' size")
    # a stream without a delta gets any prev's address: the kernel reads prevs only where delta[s]
    prev_at = addresses([p if p is not None else given[0] for p in prevs], given[0].dtype)[0] if given else cur_at
    sizes = np.diff(offsets)
    out_at = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(-(-sizes // gs), out=out_at[1:])
    out = np.empty(int(out_at[-1]), dtype=symbol_dtype(Bs[0]))
    ok = np.zeros(S, dtype=np.bool_)
    temp = np.empty(int(sizes.max()) if given else 0, dtype=np.uint8)
    _pack_many_kernel(cur_at, codes[0][:0], prev_at, given[0][:0] if given else codes[0][:0], offsets,
                      np.array(has, dtype=np.bool_), np.asarray(Bs, dtype=np.int64), gs, out_at, out, temp, ok)
    return [out[out_at[i]:out_at[i + 1]] if ok[i] else None for i in range(S)]


def unpack(symbols, n: int, B: int, *, prev=None, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack` -> the ``n`` codes, uint8 torch (every code < B <= 32: an int64 array
    of GPT-2 124M's was 1 GB of fresh pages a restore) on the symbols' device (CPU for numpy).
    With ``prev`` (n codes in [0, B)) the stream is a cyclic delta, undone in the same pass:
    ``(prev - delta) mod B``. A symbol count other than ceil(n / g), a symbol outside [0, B**g) or
    padding other than code 0 is a CorruptCheckpointError; a ``prev`` code outside [0, B) a
    ValueError."""
    g = size(B)
    if g < 2:
        raise CorruptCheckpointError(f"code buffer packs codes of an alphabet of {B}, which is never packed")
    s = torch.as_tensor(symbols).reshape(-1)
    if s.numel() != -(-n // g):
        raise CorruptCheckpointError(f"packed code stream holds {s.numel()} symbols, {n} codes need {-(-n // g)}")
    p = None if prev is None else torch.as_tensor(prev).reshape(-1)
    if p is not None and p.numel() != n:
        raise ValueError(f"a delta needs prev of {n} codes, got {p.numel()}")
    if _use_numba(backend, s) and (p is None or _use_numba(backend, p)):
        out = np.empty(n, dtype=np.uint8)
        status = _unpack_kernel(s.numpy(), B, g, out, out if p is None else p.numpy(), p is not None)
        codes = torch.from_numpy(out)
    else:
        s = s.to(torch.int64)
        status = 1 if s.numel() and (int(s.min()) < 0 or int(s.max()) >= B ** g) else 0
        powers = B ** torch.arange(g, dtype=torch.int64, device=s.device)
        codes = torch.div(s[:, None], powers, rounding_mode="floor").remainder_(B).reshape(-1)
        if not status and bool(codes[n:].any()):
            status = 3
        codes = codes[:n]
        if not status and p is not None:
            pw = p.to(torch.int64)
            status = 2 if n and (int(pw.min()) < 0 or int(pw.max()) >= B) else 0
            codes = torch.remainder(pw - codes, B)
        codes = codes.to(torch.uint8)
    if status == 1:
        raise CorruptCheckpointError(f"packed code stream has a symbol outside [0, {B ** g})")
    if status == 2:
        raise ValueError(f"prev codes must lie in [0, {B}): pass the codes of the checkpoint this delta was taken against")
    if status == 3:
        raise CorruptCheckpointError("packed code stream pads its last symbol with codes other than 0")
    return codes


if _numba is not None:
    @_numba.njit(cache=True, nogil=True)
    def _pack_kernel(c, B, g, out):  # pragma: no cover - compiled
        """out[j] = the j-th group's digits (the last group zero-padded) -> False on a code outside
        [0, B). One branch-free loop per g (2, 3 or 5): they vectorize, 20x a loop over the digits."""
        n = c.size
        whole = n // g
        bad = False
        if g == 2:
            for j in range(whole):
                x0, x1 = np.int64(c[2 * j]), np.int64(c[2 * j + 1])
                bad |= (x0 < 0) | (x0 >= B) | (x1 < 0) | (x1 >= B)
                out[j] = x0 + B * x1
        elif g == 3:
            for j in range(whole):
                x0, x1, x2 = np.int64(c[3 * j]), np.int64(c[3 * j + 1]), np.int64(c[3 * j + 2])
                bad |= (x0 < 0) | (x0 >= B) | (x1 < 0) | (x1 >= B) | (x2 < 0) | (x2 >= B)
                out[j] = x0 + B * (x1 + B * x2)
        else:
            for j in range(whole):
                x0, x1, x2 = np.int64(c[5 * j]), np.int64(c[5 * j + 1]), np.int64(c[5 * j + 2])
                x3, x4 = np.int64(c[5 * j + 3]), np.int64(c[5 * j + 4])
                bad |= (x0 < 0) | (x0 >= B) | (x1 < 0) | (x1 >= B) | (x2 < 0) | (x2 >= B)
                bad |= (x3 < 0) | (x3 >= B) | (x4 < 0) | (x4 >= B)
                out[j] = x0 + B * (x1 + B * (x2 + B * (x3 + B * x4)))
        if whole < out.size:
            t = np.int64(0)
            for i in range(n - 1, whole * g - 1, -1):
                x = np.int64(c[i])
                bad |= (x < 0) | (x >= B)
                t = t * B + x
            out[whole] = t
        return not bad

    @_numba.njit(cache=True, nogil=True)
    def _pack_many_kernel(cur_at, like_cur, prev_at, like_prev, offsets, delta, Bs, gs, out_at, out, temp,
                          ok):  # pragma: no cover - compiled
        """pack_many's streams, each read in place (inplace.py) as ``pack`` reads it: the delta into
        ``temp`` first where delta[s], then packed into out[out_at[s]:out_at[s + 1]]; ok[s]: no bad code."""
        for s in range(offsets.size - 1):
            n = offsets[s + 1] - offsets[s]
            c = segment(cur_at[s], n, like_cur)
            if delta[s]:
                x = temp[:n]
                if not _delta_kernel(segment(prev_at[s], n, like_prev), c, Bs[s], x):
                    continue
                ok[s] = _pack_kernel(x, Bs[s], gs[s], out[out_at[s]:out_at[s + 1]])
            else:
                ok[s] = _pack_kernel(c, Bs[s], gs[s], out[out_at[s]:out_at[s + 1]])

    @_numba.njit(inline="always")
    def _put(out, prev, k, d, B, delta):  # pragma: no cover - compiled
        """out[k] = digit d, or (prev[k] - d) mod B -> whether prev[k] is outside [0, B)."""
        if not delta:
            out[k] = d
            return False
        q = np.int64(prev[k])
        v = q - d
        out[k] = v + (B & (v >> 63))
        return (q < 0) | (q >= B)

    @_numba.njit(inline="always")
    def _group(s, j, G, table, top, out, prev, B, delta):  # pragma: no cover - compiled
        """Symbol j's G digits into out[G j:] -> (the symbol, whether a prev code was bad). G is a
        literal at each call: the digit loop unrolls."""
        t = np.int64(s[j])
        row = min(max(t, 0), top - 1)
        bad = False
        for i in range(G):
            bad |= _put(out, prev, G * j + i, table[row, i], B, delta)
        return t, bad

    @_numba.njit(cache=True, nogil=True)
    def _unpack_kernel(s, B, g, out, prev, delta):  # pragma: no cover - compiled
        """The n = out.size codes of symbols s (each one's g digits from a table, one loop per g),
        or with ``delta`` (prev - those digits) mod B -> 0, or 1: a symbol outside [0, B**g),
        2: a prev code outside [0, B), 3: padding other than 0."""
        top = B ** g
        table = np.empty((top, 5), dtype=np.int64)
        for t in range(top):
            v = t
            for i in range(g):
                table[t, i] = v % B
                v //= B
        n = out.size
        whole = n // g
        lo, hi = np.int64(0), np.int64(0)
        bad = False
        if g == 2:  # one loop per g, the test outside it
            for j in range(whole):
                t, b = _group(s, j, 2, table, top, out, prev, B, delta)
                lo, hi, bad = min(lo, t), max(hi, t), bad | b
        elif g == 3:
            for j in range(whole):
                t, b = _group(s, j, 3, table, top, out, prev, B, delta)
                lo, hi, bad = min(lo, t), max(hi, t), bad | b
        else:
            for j in range(whole):
                t, b = _group(s, j, 5, table, top, out, prev, B, delta)
                lo, hi, bad = min(lo, t), max(hi, t), bad | b
        if whole < s.size:  # the last symbol: its first n - whole g digits, the rest padding
            t = np.int64(s[whole])
            lo, hi = min(lo, t), max(hi, t)
            row = min(max(t, 0), top - 1)
            for i in range(g):
                if whole * g + i < n:
                    bad |= _put(out, prev, whole * g + i, table[row, i], B, delta)
                elif table[row, i] != 0 and lo >= 0 and hi < top:
                    return 3
        if lo < 0 or hi >= top:
            return 1
        return 2 if bad else 0
else:  # pragma: no cover
    _pack_kernel = _unpack_kernel = _pack_many_kernel = None
