"""Cyclic delta of quantization codes and rearrangement by source bucket (DynaQuant §6, Alg. 5-6).

Two consecutive checkpoints of one tensor, quantized to integer codes ``prev`` and ``cur``, differ
in few places late in training. The delta treats the code range as a cyclic buffer of size
``B = n_levels`` (QD-compressor's trick), so every delta is again a code in ``[0, B)``::

    D   = (prev - cur) mod B          cyclic_delta(prev, cur, B)
    cur = (prev - D)   mod B          undo_cyclic_delta(prev, D, B)

When the number of levels changed between the two checkpoints the caller passes the larger of
the two counts as ``B``. An unchanged code gives ``D = 0``, so the stream is mostly zeros.

Rearrangement (Algorithm 5) splits ``D`` into groups by the *source* bucket ``prev[j]``, keeping
the original order inside each group (a stable counting sort), because buckets migrate at very
different rates and interleaving them breaks the zero runs the run-length coder feeds on. The
inverse (Algorithm 6) needs no stored permutation: it is recomputed from ``prev``, which the
decoder already holds. Call order::

    D = cyclic_delta(prev, cur, B)
    D_sorted, group_sizes = rearrange(D, prev, B)     # group b = D[prev == b], in order
    ...                                               # run-length + entropy code D_sorted
    D = unrearrange(D_sorted, prev, B)
    cur = undo_cyclic_delta(prev, D, B)

    # the same, fused into one pass each way (what codec/entropy.py calls)
    D_sorted, group_sizes = grouped_cyclic_delta(prev, cur, B)
    cur = undo_grouped_cyclic_delta(prev, D_sorted, B)

Cost: the numba override (CPU tensors) counts and range-checks ``prev`` in one pass, then places
every element in a second (a counting sort, O(n + B)); the plain-torch reference (any device) is
an LSD radix sort over the bits of the key, O(n * ceil(log2 B)) with a stable cumsum partition
per bit. Neither uses a comparison sort. The delta itself also has a fused numba pass (range
check + subtract + wrap). Codes may be any integer dtype up to int64 (a quantizer's narrow uint8
codes go in as they are: widening them was a fresh int64 copy per tensor); a delta comes out in
``cur``'s dtype, or a wider one when ``n_levels`` needs it. Every function takes
``backend="auto" | "numba" | "torch"`` and the two backends give identical results.
"""
from __future__ import annotations

import numpy as np
import torch

from ..tensorbytes import INT_DTYPES, numpy_dtype

try:  # numba is an optional fast path; the torch reference below is always available
    import numba as _numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    _numba = None

__all__ = ["cyclic_delta", "undo_cyclic_delta", "rearrange", "unrearrange", "grouped_cyclic_delta",
           "undo_grouped_cyclic_delta", "group_order", "HAVE_NUMBA"]

HAVE_NUMBA = _numba is not None
_WIDER = (torch.int16, torch.int32, torch.int64)


# --------------------------------------------------------------------------- cyclic delta
def cyclic_delta(prev: torch.Tensor, cur: torch.Tensor, n_levels: int, *,
                 backend: str = "auto") -> torch.Tensor:
    """D = (prev - cur) mod n_levels, flat, in [0, n_levels); dtype of ``cur`` (``delta_dtype``)."""
    prev, cur = _flat_codes(prev, "prev"), _flat_codes(cur, "cur")
    _check_levels(n_levels)
    _check_same_len(prev, cur, "cur")
    dtype = delta_dtype(cur.dtype, n_levels)
    if _use_numba(backend, prev, cur):
        # numpy-allocated output: large fresh torch buffers pay a page fault per 4 KiB page
        out = np.empty(cur.numel(), dtype=numpy_dtype(dtype))
        if _delta_kernel(prev.numpy(), cur.numpy(), n_levels, out):
            return torch.from_numpy(out)
    _check_range(prev, n_levels, "prev")  # also gives the message when the kernel found a bad code
    _check_range(cur, n_levels, "cur")
    wide = _wide(prev, cur)
    return torch.remainder(prev.to(wide) - cur.to(wide), n_levels).to(dtype)


def undo_cyclic_delta(prev: torch.Tensor, delta: torch.Tensor, n_levels: int, *,
                      backend: str = "auto") -> torch.Tensor:
    """cur = (prev - D) mod n_levels: the exact inverse of :func:`cyclic_delta`."""
    prev, delta = _flat_codes(prev, "prev"), _flat_codes(delta, "delta")
    _check_levels(n_levels)
    _check_same_len(prev, delta, "delta")
    if _use_numba(backend, prev, delta):
        out = np.empty(delta.numel(), dtype=delta.numpy().dtype)
        if _undo_kernel(prev.numpy(), delta.numpy(), n_levels, out):
            return torch.from_numpy(out)
    wide = _wide(prev, delta)
    return torch.remainder(prev.to(wide) - delta.to(wide), n_levels).to(delta.dtype)  # general mod for any input


def undo_in_range(prev: torch.Tensor, delta: torch.Tensor, n_levels: int) -> torch.Tensor | None:
    """:func:`undo_cyclic_delta` of flat CPU codes as uint8 (``n_levels`` <= 256), in the kernel's
    one pass that range-checks both inputs; None where it does not run (other devices, no numba,
    more levels) or finds a code outside [0, n_levels): the caller checks and names it. A restore's
    plain delta streams decode so: an int64 result was 8 fresh bytes a code, the aminmax and
    prev-range passes before it two more reads (GPT-2 124M's embedding: 38.6M codes of 34 levels)."""
    if n_levels > 256 or delta.numel() != prev.numel() or not _use_numba("auto", delta, prev):
        return None
    out = np.empty(delta.numel(), dtype=np.uint8)
    return torch.from_numpy(out) if _undo_kernel(prev.numpy(), delta.numpy(), n_levels, out) else None


# --------------------------------------------------------------------------- rearrangement
def rearrange(delta: torch.Tensor, prev: torch.Tensor, n_levels: int, *,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``delta`` by source bucket ``prev`` (Algorithm 5), stable inside each group.

    Returns ``(D_sorted, group_sizes)``: ``D_sorted`` is the concatenation over b = 0..B-1 of
    ``delta[prev == b]`` in original order, ``group_sizes`` the (B,) int64 count of each group
    (``torch.bincount(prev, minlength=B)``). ``backend``: "auto" (numba on CPU when available),
    "numba" or "torch".
    """
    delta, prev = _flat_codes(delta, "delta"), _flat_codes(prev, "prev")
    _check_levels(n_levels)
    _check_same_len(prev, delta, "delta")
    if _use_numba(backend, delta, prev):
        sizes, starts = _numba_groups(prev, n_levels)
        out = np.empty(delta.numel(), dtype=delta.numpy().dtype)
        _scatter_by_key(delta.numpy(), prev.numpy(), starts, out)
        return torch.from_numpy(out), torch.from_numpy(sizes)
    _check_range(prev, n_levels, "prev")
    sizes = torch.bincount(prev, minlength=n_levels)
    return delta[group_order(prev, n_levels)], sizes


def unrearrange(delta_sorted: torch.Tensor, prev: torch.Tensor, n_levels: int, *,
                backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`rearrange` (Algorithm 6): the permutation is recomputed from ``prev``."""
    delta_sorted, prev = _flat_codes(delta_sorted, "delta_sorted"), _flat_codes(prev, "prev")
    _check_levels(n_levels)
    _check_same_len(prev, delta_sorted, "delta_sorted")
    if _use_numba(backend, delta_sorted, prev):
        _, starts = _numba_groups(prev, n_levels)
        out = np.empty(delta_sorted.numel(), dtype=delta_sorted.numpy().dtype)
        _gather_by_key(delta_sorted.numpy(), prev.numpy(), starts, out)
        return torch.from_numpy(out)
    _check_range(prev, n_levels, "prev")
    out = torch.empty_like(delta_sorted)
    out[group_order(prev, n_levels)] = delta_sorted
    return out


# --------------------------------------------------------------------------- fused forms
def grouped_cyclic_delta(prev: torch.Tensor, cur: torch.Tensor, n_levels: int, *,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``rearrange(cyclic_delta(prev, cur, B), prev, B)`` in one pass over the data.

    What the pipeline calls (codec/entropy.py): on CPU the fused numba kernel skips writing and
    re-reading the ungrouped delta; elsewhere it is exactly the two-step composition.
    """
    prev, cur = _flat_codes(prev, "prev"), _flat_codes(cur, "cur")
    _check_levels(n_levels)
    _check_same_len(prev, cur, "cur")
    if _use_numba(backend, cur, prev):
        sizes, starts = _numba_groups(prev, n_levels)
        out = np.empty(cur.numel(), dtype=numpy_dtype(delta_dtype(cur.dtype, n_levels)))
        if _grouped_delta_kernel(prev.numpy(), cur.numpy(), n_levels, starts, out):
            return torch.from_numpy(out), torch.from_numpy(sizes)
        _check_range(cur, n_levels, "cur")
    return rearrange(cyclic_delta(prev, cur, n_levels, backend=backend), prev, n_levels, backend=backend)


def undo_grouped_cyclic_delta(prev: torch.Tensor, delta_sorted: torch.Tensor, n_levels: int, *,
                              backend: str = "auto") -> torch.Tensor:
    """``undo_cyclic_delta(prev, unrearrange(delta_sorted, prev, B), B)`` in one pass."""
    prev, delta_sorted = _flat_codes(prev, "prev"), _flat_codes(delta_sorted, "delta_sorted")
    _check_levels(n_levels)
    _check_same_len(prev, delta_sorted, "delta_sorted")
    if _use_numba(backend, delta_sorted, prev):
        _, starts = _numba_groups(prev, n_levels)
        out = np.empty(delta_sorted.numel(), dtype=delta_sorted.numpy().dtype)
        if _undo_grouped_kernel(prev.numpy(), delta_sorted.numpy(), n_levels, starts, out):
            return torch.from_numpy(out)
    return undo_cyclic_delta(prev, unrearrange(delta_sorted, prev, n_levels, backend=backend), n_levels,
                             backend=backend)


def group_order(prev: torch.Tensor, n_levels: int) -> torch.Tensor:
    """Stable permutation that groups ``prev`` by value: ``prev[order]`` is non-decreasing.

    Plain-torch LSD radix sort (runs on any device): one stable partition per key bit, each a
    cumsum plus a scatter, so O(n * ceil(log2 n_levels)) work and no comparison sort.
    """
    prev = _flat_codes(prev, "prev")
    n = prev.numel()
    order = torch.arange(n, device=prev.device)
    keys = prev.to(torch.int64)
    idx = torch.arange(1, n + 1, device=prev.device)
    for bit in range(max(1, int(n_levels - 1).bit_length())):
        ones = (keys >> bit) & 1                       # (n,) 0/1 digit of this pass
        if n == 0:
            break
        c1 = torch.cumsum(ones, 0)                     # ones seen so far (inclusive)
        n0 = n - c1[-1]
        # zeros keep their relative order at the front, ones after them: a stable partition
        dest = torch.where(ones.bool(), n0 + c1 - 1, idx - c1 - 1)
        new_order = torch.empty_like(order)
        new_order[dest] = order
        new_keys = torch.empty_like(keys)
        new_keys[dest] = keys
        order, keys = new_order, new_keys
    return order


# --------------------------------------------------------------------------- numba kernels
def _numba_groups(prev: torch.Tensor, n_levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, starts) of the groups, counting and range-checking ``prev`` in one pass."""
    sizes = np.zeros(n_levels, dtype=np.int64)
    if not _count_kernel(prev.numpy(), n_levels, sizes):
        _check_range(prev, n_levels, "prev")  # raises with the offending range
    return sizes, np.cumsum(sizes) - sizes


if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True)
    def _delta_kernel(prev, cur, n_levels, out):  # pragma: no cover - compiled
        """out = (prev - cur) mod B with both codes range-checked; False on a bad code. Branch-free,
        so it vectorizes: 3x the loop that returned at the first bad code."""
        bad = False
        for i in range(out.shape[0]):
            p = np.int64(prev[i])  # widened first: numba's uint8 - uint8 wraps as uint64
            c = np.int64(cur[i])
            bad |= (p < 0) | (p >= n_levels) | (c < 0) | (c >= n_levels)
            d = p - c
            out[i] = d + (n_levels & (d >> 63))
        return not bad

    @_numba.njit(cache=True, nogil=True)
    def _undo_kernel(prev, delta, n_levels, out):  # pragma: no cover - compiled
        """out = (prev - D) mod B for in-range inputs; False sends the caller to the general mod.
        Branch-free, as _delta_kernel."""
        bad = False
        for i in range(out.shape[0]):
            p = np.int64(prev[i])
            d = np.int64(delta[i])
            bad |= (p < 0) | (p >= n_levels) | (d < 0) | (d >= n_levels)
            c = p - d
            out[i] = c + (n_levels & (c >> 63))
        return not bad

    @_numba.njit(cache=True, nogil=True)
    def _grouped_delta_kernel(prev, cur, n_levels, starts, out):  # pragma: no cover - compiled
        """Delta and counting-sort scatter at once; prev already range-checked."""
        pos = starts.copy()
        for j in range(cur.shape[0]):
            p = np.int64(prev[j])
            c = np.int64(cur[j])
            if c < 0 or c >= n_levels:
                return False
            d = p - c
            out[pos[p]] = d + n_levels if d < 0 else d
            pos[p] += 1
        return True

    @_numba.njit(cache=True, nogil=True)
    def _undo_grouped_kernel(prev, delta_sorted, n_levels, starts, out):  # pragma: no cover
        """Counting-sort gather and inverse delta at once; False on a delta outside [0, B)."""
        pos = starts.copy()
        for j in range(out.shape[0]):
            p = np.int64(prev[j])
            d = np.int64(delta_sorted[pos[p]])
            pos[p] += 1
            if d < 0 or d >= n_levels:
                return False
            c = p - d
            out[j] = c + n_levels if c < 0 else c
        return True

    @_numba.njit(cache=True, nogil=True)
    def _count_kernel(keys, n_levels, sizes):  # pragma: no cover - compiled
        for j in range(keys.shape[0]):
            k = np.int64(keys[j])
            if k < 0 or k >= n_levels:
                return False
            sizes[k] += 1
        return True

    @_numba.njit(cache=True, nogil=True)
    def _scatter_by_key(values, keys, starts, out):  # pragma: no cover - compiled
        pos = starts.copy()
        for j in range(values.shape[0]):
            k = keys[j]
            out[pos[k]] = values[j]
            pos[k] += 1

    @_numba.njit(cache=True, nogil=True)
    def _gather_by_key(sorted_values, keys, starts, out):  # pragma: no cover - compiled
        pos = starts.copy()
        for j in range(out.shape[0]):
            k = keys[j]
            out[j] = sorted_values[pos[k]]
            pos[k] += 1


# --------------------------------------------------------------------------- helpers
def _use_numba(backend: str, values: torch.Tensor, keys: torch.Tensor) -> bool:
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    ok = HAVE_NUMBA and values.device.type == "cpu" and keys.device.type == "cpu"
    if backend == "numba" and not ok:
        raise ValueError("backend='numba' needs numba installed and CPU tensors; use backend='auto'")
    return ok and values.numel() > 0


def _flat_codes(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer codes, got {type(t).__name__}")
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{name} must hold integer codes (uint8, int8, int16, int32 or int64), got {t.dtype}; "
                        "cast with .long()")
    return t.reshape(-1).contiguous()


def delta_dtype(dtype: torch.dtype, n_levels: int) -> torch.dtype:
    """The dtype of a delta of ``dtype`` codes: the same, or the narrowest wider one that holds
    n_levels - 1 (codes of fewer levels than the parent's, e.g. uint8 against int16)."""
    if n_levels - 1 <= torch.iinfo(dtype).max:
        return dtype
    return next(d for d in _WIDER if n_levels - 1 <= torch.iinfo(d).max)


def _wide(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """A dtype both fit in, signed (the plain-torch mod subtracts first: a uint8 difference wraps)."""
    return torch.int32 if a.element_size() <= 2 and b.element_size() <= 2 else torch.int64


def _check_levels(n_levels: int) -> None:
    if int(n_levels) != n_levels or n_levels < 1:
        raise ValueError(f"n_levels must be an integer >= 1, got {n_levels!r}")


def _check_same_len(prev: torch.Tensor, other: torch.Tensor, name: str) -> None:
    if prev.numel() != other.numel():
        raise ValueError(f"{name} has {other.numel()} codes but prev has {prev.numel()}; "
                         "pass the codes of the same tensor at both checkpoints")


def _check_range(codes: torch.Tensor, n_levels: int, name: str) -> None:
    if codes.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(codes))
    if lo < 0 or hi >= n_levels:
        raise ValueError(f"{name} codes span [{lo}, {hi}] but must lie in [0, {n_levels}); "
                         "pass n_levels = max of both checkpoints' level counts")
