"""Many arrays handed to one numba kernel in place: their addresses, not a concatenated copy.

A save's kernels run once over hundreds of tensors; joining them first (``np.concatenate``) costs a
copy of every byte, which on a small model is a tenth of the kernel's own time. Instead the kernel
gets each array's address and length and views it with ``segment``::

    addr, offsets = addresses(arrays, np.uint8)      # Python: C-contiguous 1-D arrays of one dtype
    ...
    x = segment(addr[s], offsets[s + 1] - offsets[s], like)   # in the kernel: arrays[s], no copy

``like`` is any array of that dtype (e.g. ``arrays[0][:0]``): it types the view. The caller keeps
``arrays`` alive for the call (a local list does).
"""
from __future__ import annotations

import itertools

import numpy as np

from .codec.huffman import HAVE_NUMBA

__all__ = ["addresses", "segment", "segment_offsets"]


def addresses(arrays: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(int64 addresses, int64 offsets: where each array starts in their concatenation, then the
    total) of C-contiguous 1-D ``arrays`` of ``dtype``; ValueError for any other (a kernel would read
    the wrong bytes)."""
    dtype = np.dtype(dtype)
    for a in arrays:
        if a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"in-place kernel input must be C-contiguous 1-D {dtype}, got {a.dtype} "
                             f"of shape {a.shape}{'' if a.flags.c_contiguous else ' (strided)'}")
    addr = np.fromiter((a.ctypes.data for a in arrays), dtype=np.int64, count=len(arrays))
    return addr, segment_offsets([a.size for a in arrays])


def segment_offsets(sizes) -> np.ndarray:
    """Where each of segments of ``sizes`` starts in their concatenation, then the total (int64,
    len(sizes) + 1: the kernels' segment offsets), in a third of np.cumsum's time on a list."""
    return np.fromiter(itertools.accumulate(sizes, initial=0), np.int64, len(sizes) + 1)


if HAVE_NUMBA:
    import numba as _numba
    from numba import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _pointer(typingctx, addr, like):  # pragma: no cover - compiled
        """``addr`` as a pointer to ``like``'s element type."""
        ptr = _types.CPointer(like.dtype)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))
        return ptr(_types.int64, like), codegen

    @_numba.njit(inline="always")
    def segment(addr, n, like):  # pragma: no cover - compiled
        """The ``n`` elements at ``addr`` as a 1-D array of ``like``'s dtype (no copy)."""
        return _numba.carray(_pointer(addr, like), n)
else:  # pragma: no cover - the kernels that call it exist only with numba
    segment = None
