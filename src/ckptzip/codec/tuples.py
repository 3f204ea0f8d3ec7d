"""Codes of a small alphabet coded a few to a symbol (stage ``tuple/1``).

An order-0 coder spends one state update per symbol whatever the symbol's cost: the 3-level
direction codes of Adam's ``exp_avg`` (90 % of them one level, 0.57 bits each) took as long per
code as 5-bit weight deltas. Packed ``g`` to a symbol, a stream of ``n`` codes in ``[0, B)`` is
``ceil(n / g)`` symbols in ``[0, B**g)``, the first code of each group the lowest digit and the
last group padded with code 0::

    T[j] = S[g*j] + B * S[g*j + 1] + ... + B**(g-1) * S[g*j + g - 1]

``g = size(B)`` is the largest with ``B**g <= MAX_SYMBOLS`` (B = 2: 5, B = 3: 3, B = 4 or 5: 2),
so the coder's alphabet table stays small; order-0 over the groups costs what order-0 over the
codes does, less the pairs' dependence (docs/BENCHMARKS.md, "Direction codes three to a symbol").

    syms = pack(codes, B)            # -> uint8 numpy, ceil(n / g) symbols
    codes = unpack(syms, n, B)       # -> int64 torch; CorruptCheckpointError on a bad symbol

Both have a plain torch reference (``backend="torch"``); numba kernels give the same result on CPU.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import CorruptCheckpointError

try:  # optional fast path
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["MAX_SYMBOLS", "MIN_CODES", "size", "pack", "unpack"]

MAX_SYMBOLS = 32  # B**g: the coder's alphabet and frequency table (27 for B = 3: ~60 header bytes)
MIN_CODES = 4096  # the writer's floor: below it the larger table costs more than the packing saves


def size(B: int) -> int:
    """Codes per symbol for an alphabet of ``B`` codes (1: not packed)."""
    g = 1
    while B >= 2 and B ** (g + 1) <= MAX_SYMBOLS:
        g += 1
    return g


def _fast(backend: str, t) -> bool:
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
    if backend == "numba" and _numba is None:
        raise RuntimeError("backend='numba' needs numba")
    return backend != "torch" and _numba is not None and (not isinstance(t, torch.Tensor) or t.device.type == "cpu")


def pack(codes, B: int, *, backend: str = "auto") -> np.ndarray:
    """Flat codes in ``[0, B)`` (numpy or torch, any integer dtype) -> their symbols, uint8
    (module docstring). A code outside [0, B) is a ValueError."""
    g = size(B)
    if g < 2:
        raise ValueError(f"an alphabet of {B} codes is not packed (tuples.size({B}) == 1)")
    if _fast(backend, codes):
        c = codes.numpy() if isinstance(codes, torch.Tensor) else np.asarray(codes)
        out = np.empty(-(-c.size // g), dtype=np.uint8)
        if not _pack_kernel(c.reshape(-1), B, g, out):
            raise ValueError(f"codes outside [0, {B}) cannot be packed")
        return out
    c = torch.as_tensor(codes).reshape(-1).to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= B):
        raise ValueError(f"codes outside [0, {B}) cannot be packed")
    c = torch.cat([c, c.new_zeros(-c.numel() % g)]).view(-1, g)
    weights = B ** torch.arange(g, dtype=torch.int64, device=c.device)
    return (c * weights).sum(1).to(torch.uint8).cpu().numpy()


def unpack(symbols, n: int, B: int, *, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack` -> the ``n`` codes, int64 torch on the symbols' device (CPU for
    numpy). A symbol count other than ceil(n / g), a symbol outside [0, B**g) or padding other
    than code 0 is a CorruptCheckpointError."""
    g = size(B)
    if g < 2:
        raise CorruptCheckpointError(f"code buffer packs codes of an alphabet of {B}, which is never packed")
    s = torch.as_tensor(symbols).reshape(-1)
    if s.numel() != -(-n // g):
        raise CorruptCheckpointError(f"packed code stream holds {s.numel()} symbols, {n} codes need {-(-n // g)}")
    if _fast(backend, s):
        out = np.empty(s.numel() * g, dtype=np.int64)
        if not _unpack_kernel(s.numpy(), B, g, out):
            raise CorruptCheckpointError(f"packed code stream has a symbol outside [0, {B ** g})")
        codes = torch.from_numpy(out)
    else:
        s = s.to(torch.int64)
        if s.numel() and (int(s.min()) < 0 or int(s.max()) >= B ** g):
            raise CorruptCheckpointError(f"packed code stream has a symbol outside [0, {B ** g})")
        powers = B ** torch.arange(g, dtype=torch.int64, device=s.device)
        codes = torch.div(s[:, None], powers, rounding_mode="floor").remainder_(B).reshape(-1)
    if bool(codes[n:].any()):
        raise CorruptCheckpointError("packed code stream pads its last symbol with codes other than 0")
    return codes[:n]


if _numba is not None:
    @_numba.njit(cache=True, nogil=True)
    def _pack_kernel(c, B, g, out):  # pragma: no cover - compiled
        """out[j] = the j-th group's digits (the last group zero-padded) -> False on a code outside
        [0, B). One loop per g (2, 3 or 5) in the codes' own dtype: unrolled, 20x a generic loop."""
        n = c.size
        whole = n // g
        b = c.dtype.type(B)
        bad = False
        if g == 2:
            for j in range(whole):
                x0, x1 = c[2 * j], c[2 * j + 1]
                bad |= (x0 >= b) | (x1 >= b) | (x0 < 0) | (x1 < 0)
                out[j] = x0 + b * x1
        elif g == 3:
            for j in range(whole):
                x0, x1, x2 = c[3 * j], c[3 * j + 1], c[3 * j + 2]
                bad |= (x0 >= b) | (x1 >= b) | (x2 >= b) | (x0 < 0) | (x1 < 0) | (x2 < 0)
                out[j] = x0 + b * (x1 + b * x2)
        else:
            for j in range(whole):
                x0, x1, x2, x3, x4 = c[5 * j], c[5 * j + 1], c[5 * j + 2], c[5 * j + 3], c[5 * j + 4]
                bad |= (x0 >= b) | (x1 >= b) | (x2 >= b) | (x3 >= b) | (x4 >= b)
                bad |= (x0 < 0) | (x1 < 0) | (x2 < 0) | (x3 < 0) | (x4 < 0)
                out[j] = x0 + b * (x1 + b * (x2 + b * (x3 + b * x4)))
        if whole < out.size:
            t = np.int64(0)
            for i in range(n - 1, whole * g - 1, -1):
                v = np.int64(c[i])
                bad |= v < 0 or v >= B
                t = t * B + v
            out[whole] = t
        return not bad

    @_numba.njit(cache=True, nogil=True)
    def _unpack_kernel(s, B, g, out):  # pragma: no cover - compiled
        """Each symbol's g digits from a table, one loop per g -> False on a symbol outside [0, B**g)."""
        top = B ** g
        table = np.empty((top, 5), dtype=np.int64)
        for t in range(top):
            v = t
            for i in range(g):
                table[t, i] = v % B
                v //= B
        bad = False
        if g == 2:
            for j in range(s.size):
                t = min(np.int64(s[j]), top - 1)
                bad |= np.int64(s[j]) != t
                out[2 * j], out[2 * j + 1] = table[t, 0], table[t, 1]
        elif g == 3:
            for j in range(s.size):
                t = min(np.int64(s[j]), top - 1)
                bad |= np.int64(s[j]) != t
                out[3 * j], out[3 * j + 1], out[3 * j + 2] = table[t, 0], table[t, 1], table[t, 2]
        else:
            for j in range(s.size):
                t = min(np.int64(s[j]), top - 1)
                bad |= np.int64(s[j]) != t
                out[5 * j], out[5 * j + 1], out[5 * j + 2] = table[t, 0], table[t, 1], table[t, 2]
                out[5 * j + 3], out[5 * j + 4] = table[t, 3], table[t, 4]
        return not bad and (s.size == 0 or np.int64(s.min()) >= 0)
else:  # pragma: no cover
    _pack_kernel = _unpack_kernel = None
