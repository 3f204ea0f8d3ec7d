"""Per-thread buffers the codec kernels reuse from call to call.

A fresh array per call costs its page faults every time (~10 % of a small tensor's compress on
this VM); a buffer kept per thread is grown on demand and handed out as a view::

    buf = scratch("planes", n, np.uint8, keep=1 << 23)   # n elements, valid until this thread's next call

A request over ``keep`` bytes gets a fresh array that is not kept: a large model's buffers are
memory for that call alone. Each name is one buffer per thread: a caller must be done with a view
before it asks for the same name again.
"""
from __future__ import annotations

import threading

import numpy as np

_local = threading.local()
_MIN_ELEMENTS = 1 << 16  # the smallest buffer kept: small calls do not regrow it each time


def scratch(name: str, n: int, dtype, *, keep: int) -> np.ndarray:
    """``n`` elements of ``dtype`` from this thread's buffer ``name``; a fresh array over ``keep`` bytes."""
    if n * np.dtype(dtype).itemsize > keep:
        return np.empty(n, dtype=dtype)
    buf = getattr(_local, name, None)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = np.empty(max(n, _MIN_ELEMENTS), dtype=dtype)
        setattr(_local, name, buf)
    return buf[:n]
