"""Run-length encoding with the sign trick (DynaQuant §6, "Encoding Delta").

Plain RLE writes a (value, length) pair per run and doubles the size of a stream whose runs are
mostly of length one. Here a run length is written only when it is greater than one, and values
are stored negated so the two kinds of entry can be told apart::

    run of value v (v >= 0), length L   ->   -v          if L == 1
                                             -v, L       if L >= 2

Every value entry is <= 0 and every length entry is >= 2 (a length of 1 is never written, and a
decoder rejects it). A zero value is stored as -0 == 0, which is still "<= 0", so it needs no
special case. Example::

    rle_encode([0, 0, 0, 3, 1, 1])  ->  [0, 3, -3, -1, 2]
    rle_decode([0, 3, -3, -1, 2])   ->  [0, 0, 0, 3, 1, 1]

Groups: ``rle_encode(x, group_sizes=...)`` cuts runs at group boundaries so that each group of a
rearranged delta (codec/delta.py) is encoded separately, as in the paper. The output is still one
stream and :func:`rle_decode` needs no group sizes: decoding per group and concatenating gives the
same values as decoding the whole stream. Runs that cross boundaries (``group_sizes=None``) are
never longer and are what ``codec.entropy.encode_codes`` uses.

The reference in both directions is vectorized torch (run boundaries by comparison + nonzero,
entries placed by scatter) and runs on any device; on CPU tensors a numba kernel (one pass each
way, same checks, same output) overrides it when numba is installed (``backend="auto"``).
Both return int64.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import CorruptCheckpointError

try:  # optional fast path
    import numba as _numba
except ImportError:  # pragma: no cover
    _numba = None

__all__ = ["rle_encode", "rle_decode", "run_count", "HAVE_NUMBA"]

HAVE_NUMBA = _numba is not None

_INT64_MIN = -(2**63)


def rle_encode(x: torch.Tensor, group_sizes: torch.Tensor | None = None, *,
               backend: str = "auto") -> torch.Tensor:
    """Encode a flat stream of values >= 0 into the signed RLE stream (int64, same device).

    ``group_sizes``: optional counts (summing to ``len(x)``) of consecutive groups that runs must
    not cross. ``backend``: "auto" (numba on CPU when installed), "numba" or "torch".
    """
    x = _flat_int(x, "x").contiguous()
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    lo = int(x.min())
    if lo < 0:
        raise ValueError(f"rle_encode needs values >= 0, got a minimum of {lo}; offset the values first")
    cuts = _group_starts(group_sizes, n, x.device) if group_sizes is not None else None
    if _use_numba(backend, x) and x.dtype != torch.uint64:  # the kernel reads narrow values as they are
        ends = np.zeros(0, np.int64) if cuts is None else cuts.numpy()
        out = np.empty(n, dtype=np.int64)          # a run of length L writes min(L, 2) <= L entries
        used = _encode_kernel(x.numpy(), ends, out)
        return torch.from_numpy(out[:used].copy())
    x = x.to(torch.int64)
    new_run = torch.ones(n, dtype=torch.bool, device=x.device)   # (n,) True where a run starts
    new_run[1:] = x[1:] != x[:-1]
    if cuts is not None:
        new_run[cuts] = True
    starts = torch.nonzero(new_run).reshape(-1)                  # (r,) first index of each run
    lengths = torch.diff(starts, append=starts.new_tensor([n]))  # (r,)
    has_len = lengths > 1
    slots = 1 + has_len.to(torch.int64)                          # entries each run writes
    offsets = torch.cumsum(slots, 0) - slots
    out = torch.empty(int(offsets[-1] + slots[-1]), dtype=torch.int64, device=x.device)
    out[offsets] = -x[starts]
    out[offsets[has_len] + 1] = lengths[has_len]
    return out


def rle_decode(stream: torch.Tensor, n: int | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Decode a signed RLE stream back to its values (int64, same device).

    ``n``: the expected number of values. Pass it whenever it is known (a header field): a
    corrupt run length is then rejected before anything large is allocated.
    Raises CorruptCheckpointError on a malformed stream.
    """
    s = _flat_int(stream, "stream").to(torch.int64)
    if s.numel() == 0:
        if n:
            raise CorruptCheckpointError(f"RLE stream is empty but {n} values were expected")
        return torch.empty(0, dtype=torch.int64, device=s.device)
    if _use_numba(backend, s):
        return _decode_numba(s.contiguous().numpy(), n)
    if int(s.min()) == _INT64_MIN:  # its negation overflows back to a negative value
        raise CorruptCheckpointError("RLE stream holds a value that cannot be negated")
    is_val = s <= 0
    is_len = ~is_val
    if bool(is_len[0]):
        raise CorruptCheckpointError("RLE stream starts with a run length instead of a value")
    if bool((is_len[1:] & is_len[:-1]).any()):
        raise CorruptCheckpointError("RLE stream has two run lengths in a row")
    run_lengths = s[is_len]
    if run_lengths.numel() and int(run_lengths.min()) < 2:
        raise CorruptCheckpointError("RLE stream holds a run length of 1, which is never written")
    if n is not None and run_lengths.numel() and int(run_lengths.max()) > n:
        raise CorruptCheckpointError(f"RLE run length {int(run_lengths.max())} exceeds the {n} values expected")
    values = -s[is_val]
    lengths = torch.ones_like(values)
    run_of = torch.cumsum(is_val.to(torch.int64), 0) - 1          # (len(s),) run index of each entry
    lengths[run_of[is_len]] = run_lengths
    total = int(lengths.sum())  # with n given: <= n * n, exact for n < 3e9
    if n is not None and total != n:
        raise CorruptCheckpointError(f"RLE stream decodes to {total} values, expected {n}")
    return torch.repeat_interleave(values, lengths, output_size=total)


def run_count(x: torch.Tensor) -> int:
    """Number of runs in ``x`` (cheap size estimate: the RLE stream has runs + long-runs entries)."""
    x = _flat_int(x, "x")
    if x.numel() == 0:
        return 0
    return int((x[1:] != x[:-1]).sum()) + 1


def _decode_numba(s: np.ndarray, n: int | None) -> torch.Tensor:
    total, longest, err = _scan_kernel(s)
    if err:
        raise CorruptCheckpointError(_ERRORS[err])
    if n is not None and longest > n:
        raise CorruptCheckpointError(f"RLE run length {longest} exceeds the {n} values expected")
    if n is not None and total != n:
        raise CorruptCheckpointError(f"RLE stream decodes to {total} values, expected {n}")
    out = np.empty(total, dtype=np.int64)
    _expand_kernel(s, out)
    return torch.from_numpy(out)


_ERRORS = {
    1: "RLE stream starts with a run length instead of a value",
    2: "RLE stream has two run lengths in a row",
    3: "RLE stream holds a run length of 1, which is never written",
    4: "RLE stream holds a value that cannot be negated",
    5: "RLE stream decodes to more than 2**62 values",
}

if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True)
    def _encode_kernel(x, cuts, out):  # pragma: no cover - compiled
        """One pass: -v per run, then L when L > 1; runs stop at x changes and at ``cuts``."""
        n = x.shape[0]
        pos = 0
        i = 0
        for g in range(cuts.shape[0] + 1):
            end = cuts[g] if g < cuts.shape[0] else n
            while i < end:
                v = np.int64(x[i])  # widened first: numba negates a uint8 as a wrapping uint8
                j = i + 1
                while j < end and x[j] == v:
                    j += 1
                out[pos] = -v
                pos += 1
                if j - i > 1:
                    out[pos] = j - i
                    pos += 1
                i = j
        return pos

    @_numba.njit(cache=True, nogil=True)
    def _scan_kernel(s):  # pragma: no cover - compiled
        """Validate a stream -> (decoded length, longest run, error code or 0)."""
        total = 0
        longest = 0
        k = 0
        m = s.shape[0]
        while k < m:
            v = s[k]
            if v > 0:
                return total, longest, 1 if k == 0 else 2
            if v == -9223372036854775807 - 1:
                return total, longest, 4
            k += 1
            run = 1
            if k < m and s[k] > 0:
                run = s[k]
                k += 1
                if run < 2:
                    return total, longest, 3
            if run > longest:
                longest = run
            total += run
            if total > 4611686018427387904:
                return total, longest, 5
        return total, longest, 0

    @_numba.njit(cache=True, nogil=True)
    def _expand_kernel(s, out):  # pragma: no cover - compiled
        """Write the runs of a stream already checked by _scan_kernel."""
        pos = 0
        k = 0
        m = s.shape[0]
        while k < m:
            v = -s[k]
            k += 1
            run = 1
            if k < m and s[k] > 0:
                run = s[k]
                k += 1
            for t in range(run):
                out[pos + t] = v
            pos += run


def _use_numba(backend: str, t: torch.Tensor) -> bool:
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"backend must be 'auto', 'numba' or 'torch', got {backend!r}")
    ok = HAVE_NUMBA and t.device.type == "cpu"
    if backend == "numba" and not ok:
        raise ValueError("backend='numba' needs numba installed and a CPU tensor; use backend='auto'")
    return ok and backend != "torch"


def _group_starts(group_sizes: torch.Tensor, n: int, device) -> torch.Tensor:
    sizes = torch.as_tensor(group_sizes, dtype=torch.int64, device=device).reshape(-1)
    if sizes.numel() and (int(sizes.min()) < 0 or int(sizes.sum()) != n):
        raise ValueError(f"group_sizes must be >= 0 and sum to len(x) = {n}, "
                         f"got a sum of {int(sizes.sum())}")
    ends = torch.cumsum(sizes, 0)
    return ends[ends < n]


def _flat_int(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    return t.reshape(-1)
