"""Optimizer-moment quantizers (issue 14): Adam's v on a fixed log grid, m as a few-bit direction.

Adam's update is d = m_hat / D with D = sqrt(v_hat) + eps (hats: bias-corrected). What a resume
needs is D to within a few percent and the sign pattern of m / D; what it must never get is a D
far below the truth (m / D too large: the first updates explode, bench/resume.py "zero-v").

**v: the denominator on a fixed log grid.** t = log2(D / eps) >= 0 is rounded to a grid of
``step`` (in log2 units, so a level is a factor 2**step in D): code c = round(t / step) (half up,
exactly: by comparing D / eps with the grid's fp32 bounds, ``grid_bounds``), at least 1 for any
v > 0 or m != 0, and 0 only where v == 0 and m == 0 (an exact zero). D, and m / D below, are
correctly rounded fp32 (``base.sqrt_rn``): the codes are the same on every machine and device.
The grid does not depend on the tensor or the checkpoint, so a v that moved by less than a bin keeps its code and
the code delta against the previous checkpoint is zero (v moves slowly at beta2 = 0.999).
Decode: D_q = eps * 2**(c * step), v_q = (D_q - eps)**2 * (1 - beta2**step_count). Coding D
rather than v is PaddleNLP's "store the step factor" idea: every v below ~eps**2 is one level.
Factored (``factored=True``, 2-D tensors): the codes are predicted by integer row and column
effects, c ~ a_i + b_j (as Adafactor keeps v as row x column statistics, here in the log domain),
and the residual r = c - a_i - b_j is coded (zigzag); a and b are exact int16 side tensors.

**m: the normalized direction at 1-3 bits.** u = m / D (``normalize="true"``: the exact D, so
the restored first update m_q / D_q = u_q approximates the true one; ``"decoded"``: D_q, as the
v0.1 recipe normalizes), split into groups of ``group`` consecutive elements; each group has a
bf16 scale s (mean |u| of what it keeps for 1 bit, summed in fp64; RMS otherwise) and z = u / s is
rounded to a fixed level table (1 bit: sign; 2 and 3 bits: Lloyd-Max levels of a unit Gaussian). ``prune`` > 0
adds a zero level for |u| at or below the quantile ``prune`` of |u| (ExCP's momentum pruning by
magnitude; 1 bit + prune = ternary).
Decode: u_q = levels[code] * s, m_q = u_q * D_q, and 0 where v has the zero level (both exactly
zero: e.g. weights of an input that is always zero).

Call order (decode v before m: m needs D_q)::

    hp = AdamHP(step, beta1, beta2, eps)
    qm, qv = encode_pair(m, v, hp, GridCodec())     # = quantize_v, then quantize_m by D
    qm, qv, c = encode_pair_levels(m, v, hp, codec) # the same and v's absolute levels c = decode_grid(qv)
    [(qm, qv, c), ...] = encode_pairs_levels([(m, v, hp), ...], codec)  # many at once, the same results
    m_q, v_q = decode_pair(qm, qv, hp)              # = decode_denominator, v_from_denominator, dequantize_m

SGD momentum (no v): ``quantize_m(buf, None, ...)`` quantizes the buffer itself (D = 1).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.scratch import scratch
from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError, NonFiniteError
from ..inplace import segment_offsets
from ..tensorbytes import dtype_name, narrowest_int, numpy_dtype, torch_dtype
from . import momentkernels as K
from .base import MIN_NUMEL_RANGE, QuantizedTensor, all_finite, compact, flat32, sqrt_rn

# Positive reconstruction levels in units of the group scale: 1 bit, +-1 times the mean |u| (the
# L2-optimal scale of a sign); 2 and 3 bits, the Lloyd-Max levels of a unit Gaussian (z = u / RMS).
# Decision thresholds are the midpoints.
_LEVELS = {1: (1.0,), 2: (0.4528, 1.510), 3: (0.2451, 0.7560, 1.344, 2.152)}


@dataclass(frozen=True)
class AdamHP:
    """What Adam's update needs beside m and v for one parameter."""

    step: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if not self.step >= 1:
            raise ConfigError(f"AdamHP.step must be >= 1 (an Adam state that has taken a step), got {self.step}")

    @property
    def bc2(self) -> float:
        return 1.0 - self.beta2 ** self.step


def _f32(x: torch.Tensor, name: str) -> torch.Tensor:
    """x flat fp32, checked finite: the public entry points check each moment once, at the door."""
    xf = x.detach().reshape(-1).to(torch.float32)
    if not all_finite(xf):
        raise NonFiniteError(f"{name}: optimizer moment holds inf/NaN; store it exact")
    return xf


def denominator(v: torch.Tensor, hp: AdamHP) -> torch.Tensor:
    """D = sqrt(v / (1 - beta2^t)) + eps, flat fp32."""
    return _denominator(_f32(v, "exp_avg_sq"), hp.bc2, hp.eps)


def _denominator(vf: torch.Tensor, bc2: float | torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """D of flat fp32 ``vf``; ``bc2`` and ``eps`` scalars or one per element (a batch of tensors).
    Every step is correctly rounded in fp32 (base.sqrt_rn), so the same on any machine and in
    grid_kernel."""
    return sqrt_rn(vf.clamp_min(0).div_(bc2)).add_(eps)


# ---------------------------------------------------------------------------------------------
# v: the denominator on a fixed log grid

MIN_STEP = 2.0 ** -10  # a finer grid's bounds table (128 / step entries) and compares grow without use


@functools.lru_cache(maxsize=8)
def grid_bounds(step: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The grid's level bounds: code c = #{k >= 1: y >= B[k]} for y = D / eps, where B[k] is the
    least fp32 >= 2**(step * (k - 1/2)) (k = 1..K, every bound below 2**128), i.e. log2(y) / step
    rounded half up, exactly (no log2: its last bit differs between devices and libraries).
    Returns (lo, thr, B, width) for grid_kernel: by an fp32's exponent bits x, lo[x] = #{k: B[k] <
    2**(x - 127)} (the bounds below its binade; x = 255, inf: all K), thr[x] the bits of the next
    bound (0xFFFFFFFF: none); B with B[0] unused and ``width`` NaN after B[K] (no y is >= NaN);
    ``width`` the most bounds inside one binade."""
    if not step >= MIN_STEP:
        raise ConfigError(f"moment grid step must be >= 2**-10 (log2 units), got {step}")
    n = math.ceil(128 / step + 0.5) - 1  # k < 128 / step + 1/2
    exact = np.exp2(step * (np.arange(1, n + 1, dtype=np.float64) - 0.5))
    b = exact.astype(np.float32)
    low = b.astype(np.float64) < exact
    b[low] = np.nextafter(b[low], np.float32(np.inf))
    lo = np.zeros(256, dtype=np.int32)  # y >= 1: exponent bits 127 .. 255
    lo[127:255] = np.searchsorted(b, np.exp2(np.arange(128, dtype=np.float64)), side="left")
    lo[255] = n
    width = max(1, int(np.diff(lo[127:]).max()))
    table = np.concatenate([np.zeros(1, np.float32), b, np.full(width, np.nan, np.float32)])
    thr = np.full(256, 0xFFFFFFFF, dtype=np.uint32)
    inside = lo < n
    thr[inside] = table[lo[inside] + 1].view(np.uint32)
    return lo, thr, table, width


def _pow2(step: float) -> int:
    """s where ``step`` is 2**s for an integer s >= 1 (the grid kernel's table-free codes), else 0."""
    m, e = math.frexp(step)
    return e - 1 if m == 0.5 and e >= 2 else 0


def _zigzag(r: torch.Tensor) -> torch.Tensor:
    """r >= 0 -> 2r, r < 0 -> -2r - 1 (int64; by shifts: two passes fewer than a where)."""
    return (r << 1) ^ (r >> 63)


def _unzigzag(z: torch.Tensor) -> torch.Tensor:
    """Inverse of _zigzag: even z -> z // 2, odd z -> -(z + 1) // 2 (floor division, any int64 z)."""
    return (z >> 1) ^ -(z & 1)


def _as_2d(shape) -> tuple[int, int] | None:
    if len(shape) < 2 or shape[0] < 2 or math.prod(shape[1:]) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def grid_codes(v: torch.Tensor, hp: AdamHP, step: float, m: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute grid codes c (see grid_bounds), int64 flat; 0 only for v == 0 == m."""
    return _grid([v], None if m is None else [m], [hp], step)[3].long()


def _grid(vs: list[torch.Tensor], ms: list[torch.Tensor] | None, hps: list[AdamHP], step: float
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, int | None]:
    """(vf, mf, D, c, max c or None) of tensors ``vs`` (and ``ms``) concatenated, each checked finite:
    their flat fp32 values, Adam's denominator and the grid codes (int32 from grid_kernel, int64
    from the torch reference below it)."""
    lo, thr, table, width = grid_bounds(step)
    vf = _cat32(vs, "moments.v")
    mf = None if ms is None else _cat32(ms, "moments.m")
    ns = [v.numel() for v in vs]
    if _use_kernels(vf):  # the whole pass in one kernel (quant/momentkernels.py)
        D = scratch("moments.D", vf.numel(), np.float32, keep=_KEEP)
        out = scratch("moments.c", vf.numel(), np.int32, keep=_KEEP)
        per = [np.array([getattr(hp, k) for hp in hps], dtype=np.float32) for k in ("bc2", "eps")]
        top = int(K.grid_kernel(vf.numpy(), vf.numpy()[:0] if mf is None else mf.numpy(), segment_offsets(ns), *per, lo,
                                thr, table, width, _pow2(step), D, out))
        if top >= 0:
            return vf, mf, torch.from_numpy(D), torch.from_numpy(out), top
    for i, v in enumerate(vs):  # the one that is not finite is named
        _f32(v, "exp_avg_sq")
        if ms is not None:
            _f32(ms[i], "exp_avg")
    bc2, eps = (_per_element([getattr(hp, k) for hp in hps], ns, vf) for k in ("bc2", "eps"))
    D = _denominator(vf, bc2, eps)
    bounds = torch.from_numpy(table[1:len(table) - width]).to(D.device)
    c = torch.bucketize(torch.div(D, eps), bounds, right=True).clamp_min_(1)
    zero = vf == 0
    if mf is not None:
        zero &= mf == 0
    return vf, mf, D, c.masked_fill_(zero, 0), None


def _use_kernels(x: torch.Tensor) -> bool:
    """Whether the numba tails of quant/momentkernels.py run (CPU, numba installed); else the torch reference."""
    return K.HAVE_NUMBA and x.device.type == "cpu"


def quantize_v(v: torch.Tensor, hp: AdamHP, *, step: float = 0.5, factored: bool = False,
               m: torch.Tensor | None = None) -> QuantizedTensor:
    """v (exp_avg_sq) -> grid codes (factored: zigzag residuals, int16 side ``row``/``col``)."""
    *_, c, top = _grid([v], None if m is None else [m], [hp], step)
    return _grid_record(c.clone(), v, step, factored, top)  # not the kernel's scratch: the record outlives it


def _grid_record(c: torch.Tensor, v: torch.Tensor, step: float, factored: bool, cmax: int | None = None
                 ) -> QuantizedTensor:
    """quantize_v's record of v's absolute grid codes c (``cmax``: a bound on them, if known)."""
    side, meta, top = {}, {"step": step, "factored": False}, None
    rc = _as_2d(v.shape) if factored else None
    if rc is not None:
        if _use_kernels(c) and c.is_contiguous() and cmax is not None and 4 * (cmax + 1) * max(rc) < 2 ** 24:
            # every sum below 2**24 (|c - a| <= 2 max c): the kernel's exact sums give torch's means
            a, b = torch.empty(rc[0], dtype=torch.float32), torch.empty(rc[1], dtype=torch.float32)
            effects = float(K.factored_effects(c.numpy(), rc[0], rc[1], a.numpy(), b.numpy()))
        else:
            c2 = c.reshape(rc).to(torch.float32)
            a = torch.round(c2.mean(1))
            b = torch.round(c2.sub_(a[:, None]).mean(0))  # in place: c2 is this function's own copy
            del c2  # before the residuals' int64 output (a save's peak memory is this function on its largest v)
            effects = max(float(a.abs().max()), float(b.abs().max()))
        if effects < 2 ** 15:
            if _use_kernels(c) and c.is_contiguous():  # the tail below in one pass (momentkernels.py)
                # |c - (a + b)| <= max c + 2 max|effect|: zigzag at most twice that, in the narrowest dtype
                bound = 2 * ((int(c.max()) if cmax is None else cmax) + 2 * int(effects))
                out = np.empty(c.numel(), dtype=numpy_dtype(narrowest_int(bound)))
                top = int(K.factored_tail(c.numpy(), a.numpy(), b.numpy(), out))
                c = torch.from_numpy(out)
            else:
                c = _zigzag(c - (a[:, None] + b[None, :]).to(torch.int64).reshape(-1))
            side = {"row": a.to(torch.int16), "col": b.to(torch.int16)}
            meta["factored"] = True
    if top is None:
        top = int(c.max()) if c.numel() else 0
    return QuantizedTensor(codes=c, n_levels=top + 1, codebook=torch.empty(0), shape=tuple(v.shape),
                           dtype=dtype_name(v.dtype), side=side, meta=meta)


def decode_grid(q: QuantizedTensor) -> torch.Tensor:
    """Absolute grid codes (flat) of a quantize_v result: int64, or the record's own narrow codes
    (a packed stream's uint8: an int64 copy of GPT-2 124M's would be 1 GB of fresh pages)."""
    c = q.codes.reshape(-1)
    if q.meta.get("factored"):
        rc = _as_2d(q.shape)
        row, col = q.side.get("row"), q.side.get("col")
        if rc is None or row is None or col is None or row.numel() != rc[0] or col.numel() != rc[1]:
            raise ValueError(f"factored grid codes need row/col effects of sizes {rc}")
        if _use_kernels(c) and c.is_contiguous() and row.device.type == col.device.type == "cpu":
            out = np.empty(c.numel(), dtype=np.int64)  # the levels in one pass (quant/momentkernels.py)
            low = int(K.factored_levels(c.numpy(), row.contiguous().numpy(), col.contiguous().numpy(), out))
            c = torch.from_numpy(out)
        else:
            pred = row.to(c.device, torch.int64)[:, None] + col.to(c.device, torch.int64)[None, :]
            c = _unzigzag(c.to(torch.int64)) + pred.reshape(-1)
            low = int(c.min()) if c.numel() else 0
        if low < 0:
            raise ValueError("factored grid codes decode to a negative level")
    return c if c.dtype == torch.uint8 else c.to(torch.int64)


def decode_denominator(q: QuantizedTensor, hp: AdamHP, codes: torch.Tensor | None = None) -> torch.Tensor:
    """D_q = eps * 2**(c * step), flat fp32 (c = 0: D = eps, i.e. v = 0); ``codes``: decode_grid(q)."""
    c = decode_grid(q) if codes is None else codes
    step = float(q.meta["step"])
    return _map_f64(c, _d_map(step, hp.eps), torch.float32)


def v_from_denominator(D: torch.Tensor, hp: AdamHP, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """v = (D - eps)^2 * (1 - beta2^t): the exp_avg_sq Adam will read."""
    return _map_f64(D, _v_map(hp.eps, hp.bc2), dtype).reshape(shape)


def _d_map(step: float, eps: float):
    return lambda w: w.mul_(step).exp2_().mul_(eps)


def _v_map(eps: float, bc2: float):
    return lambda w: w.sub_(eps).clamp_min_(0).square_().mul_(bc2)


def decode_v(q: QuantizedTensor, hp: AdamHP, codes: torch.Tensor | None = None, *, top: int | None = None,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(v_q in q's shape and ``dtype``, D_q, d_table) of a grid record: v_from_denominator of
    decode_denominator, the same floats. D_q comes per element (flat fp32, d_table None) or, on the
    CPU where exact (_d_table), as its value per level (D_q = d_table[codes], D_q None), which
    dequantize_m reads without a tensor of D. ``codes``: decode_grid(q); ``top``: their max where
    the caller has it. The tables took GPT-2 124M's restore from two float64 maps over its v (one
    with exp2) and a fresh fp32 D to one lookup pass."""
    c = decode_grid(q) if codes is None else codes
    tables = None
    if _use_kernels(c) and c.is_contiguous() and dtype == torch.float32 and c.numel():
        if top is None:
            top = np.iinfo(np.uint8).max if c.dtype == torch.uint8 else int(c.max())
        if top < _TABLE_LEVELS:
            tables = _level_tables(float(q.meta["step"]), hp.eps, hp.bc2, max(64, 1 << top.bit_length()))
    if tables is None:
        D = decode_denominator(q, hp, c)
        return v_from_denominator(D, hp, q.shape, dtype), D, None
    v = torch.empty(c.numel(), dtype=torch.float32)
    if not K.level_values(c.reshape(-1).numpy(), tables[1].numpy(), v.numpy()):
        raise ValueError(f"grid codes outside the {tables[1].numel()} levels of the decode tables")
    return v.reshape(q.shape), None, tables[0]


# grid levels that decode through tables (GridCodec's levels: ~64 at the default step); past them,
# the elementwise maps
_TABLE_LEVELS = 1 << 12
# copies of each level in the tables' vector-path probe: whole SIMD loops at any width torch has
_PROBE_COPIES = 64


@functools.lru_cache(maxsize=64)
def _level_tables(step: float, eps: float, bc2: float, size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """decode_denominator's and v_from_denominator's fp32 values of the levels 0..size-1, or None
    where D's are not what the elementwise map gives every element (_d_table). v's map is IEEE
    arithmetic, the same on either path. Kept per bc2 (Adam's step count: each checkpoint's own),
    D's table per grid."""
    d = _d_table(step, eps, size)
    return None if d is None else (d, _map_f64(d, _v_map(eps, bc2), torch.float32))


@functools.lru_cache(maxsize=16)
def _d_table(step: float, eps: float, size: int) -> torch.Tensor | None:
    """D of the levels 0..size-1, if each is the same on both of torch's paths. Its vectorized body
    and scalar tail are different code (float64 exp2: SLEEF or libm, which differ in the last bit
    for ~7 % of inputs), so an element's D depends on where it sits in the tensor; the table is
    kept only if every level's D is the same alone (the scalar tail) and in whole vectors."""
    levels = torch.arange(size, dtype=torch.float64)
    d_map = _d_map(step, eps)
    wide = _map_f64(levels.repeat_interleave(_PROBE_COPIES), d_map, torch.float32).view(size, _PROBE_COPIES)
    alone = torch.cat([_map_f64(levels[i:i + 1], d_map, torch.float32) for i in range(size)])
    return alone if bool((wide == alone[:, None]).all()) else None


# bytes of a batch's fp32 / int32 temporaries kept per thread between saves (codec/scratch.py): a
# small model's fresh pages cost more than its kernels (~2.5 us a page on a VM); a batch holds up to
# methods/moments.BATCH_NUMEL (1M) elements, larger tensors get fresh arrays that are not kept
_KEEP = 1 << 22

# elements per pass of the chunked maps on the CPU (one reused buffer); a multiple of every SIMD width,
# so each element takes the vectorized or the scalar path it takes in one pass over the whole tensor
_CHUNK = 1 << 20


def _map_f64(x: torch.Tensor, fn, dtype: torch.dtype) -> torch.Tensor:
    """``fn(x.to(float64)).to(dtype)`` flat, ``fn`` in place on a float64 buffer (the same values).
    On the CPU in chunks through one reused buffer: a float64 copy of the whole tensor was 8 fresh
    bytes an element, and a fresh page costs 5-12 us on a VM (GPT-2 124M's v: 244k page faults a
    restore); on other devices in one pass."""
    x = x.reshape(-1)
    n = x.numel()
    chunk = _CHUNK if x.device.type == "cpu" else max(n, 1)
    out = torch.empty(n, dtype=dtype, device=x.device)
    buf = torch.empty(min(n, chunk), dtype=torch.float64, device=x.device)
    for a in range(0, n, chunk):
        w = buf[:min(chunk, n - a)]
        fn(w.copy_(x[a:a + chunk]))
        out[a:a + chunk].copy_(w)
    return out


# ---------------------------------------------------------------------------------------------
# m: the normalized direction at 1-3 bits

def levels_table(bits: int, prune: float) -> torch.Tensor:
    """Sorted reconstruction levels in units of the group scale (with 0 when pruning). One tensor
    per table, shared by every record that uses it (the codebook of a save's m records): never
    modify it."""
    if bits not in _LEVELS:
        raise ConfigError(f"moment bits must be one of {sorted(_LEVELS)}, got {bits}")
    return _levels_table(bits, prune > 0)


@functools.lru_cache(maxsize=None)
def _levels_table(bits: int, pruned: bool) -> torch.Tensor:
    half = torch.tensor(_LEVELS[bits], dtype=torch.float32)
    mid = torch.zeros(1) if pruned else torch.empty(0)
    return torch.cat([-half.flip(0), mid, half])


def quantize_m(m: torch.Tensor, D: torch.Tensor | None, *, bits: int = 1, group: int = 128,
               prune: float = 0.0) -> QuantizedTensor:
    """u = m / D (D None: u = m) -> codes into ``levels_table`` with a bf16 scale per group."""
    return _quantize_m(_f32(m, "exp_avg"), D, m, bits=bits, group=group, prune=prune)


def _quantize_m(mf: torch.Tensor, D: torch.Tensor | None, m: torch.Tensor, *, bits: int, group: int,
                prune: float) -> QuantizedTensor:
    """quantize_m of checked flat fp32 ``mf`` (``m``: the tensor, for its shape and dtype)."""
    return _quantize_ms(mf, D, [m], bits=bits, group=group, prune=prune)[0]


def _quantize_ms(mf: torch.Tensor, D: torch.Tensor | None, ms: list[torch.Tensor], *, bits: int, group: int,
                 prune: float) -> list[QuantizedTensor]:
    """_quantize_m of many tensors at once: ``mf`` (and ``D``) hold the flat fp32 values of every
    tensor in ``ms``, one after the other. Each tensor is padded to whole groups of its own, so its
    groups, cut and codes are the ones it gets alone (tests/test_quant_moments.py); the elementwise
    passes run once over all of them (on small tensors each pass costs more than its bytes)."""
    if not isinstance(group, int) or group < 1:
        raise ConfigError(f"moment group must be an int >= 1, got {group!r}")
    if not 0.0 <= prune < 1.0:
        raise ConfigError(f"moment prune must be in [0, 1), got {prune}")
    if bits == 1 and _use_kernels(mf):
        return _sign_fused(mf, D, ms, group=group, prune=prune)
    u = mf if D is None else mf / D.reshape(-1).to(mf.device)
    ns = [x.numel() for x in ms]
    pads = [(-n) % group for n in ns]
    starts = [0]
    for n, pad in zip(ns, pads):
        starts.append(starts[-1] + n + pad)
    if any(pads):  # each tensor's last group padded with zeros
        pieces = []
        for at, n, pad in zip(segment_offsets(ns).tolist(), ns, pads):
            pieces += [u[at:at + n], u.new_zeros(pad)] if pad else [u[at:at + n]]
        ug = torch.cat(pieces).reshape(-1, group)
    else:
        ug = u.reshape(-1, group)
    rows = [(n + pad) // group for n, pad in zip(ns, pads)]
    levels = levels_table(bits, prune).to(u.device)
    cut = None
    a = ug.abs() if prune > 0 or bits == 1 else None  # |u|, padded
    if prune > 0 and ug.numel():  # per tensor, from a strided sample of its own |u|
        flat = a.reshape(-1)
        cuts = torch.stack([_quantile(flat[at:at + n:_cut_stride(n)], prune) if n else flat.new_zeros(())
                            for at, n in zip(starts, ns)])
        cut = torch.cat([c.expand(r) for c, r in zip(cuts, rows)])[:, None]
    if bits == 1:  # sign: the L2-optimal scale of a group is the mean |u| of what it keeps
        keep = a > cut if cut is not None else torch.ones_like(ug, dtype=torch.bool)
        s = _kept_mean(a, keep)
    else:
        s = ug.square().sum(1).div_(torch.full_like(ug[:, 0], group)).sqrt_()
        for at, end, n, pad in zip(segment_offsets(ns).tolist(), starts[1:], ns, pads):
            if pad:  # the last group is short: its RMS over its real elements
                s[end // group - 1] = u[at + n - (group - pad):at + n].square().mean().sqrt()
    s = s.to(torch.bfloat16)
    z = ug / s.float().clamp_min(1e-38)[:, None]
    signed = levels[levels != 0]
    bounds = (signed[1:] + signed[:-1]) / 2
    # uint8 codes (at most 9 levels) in few passes: on a small tensor each pass costs more than its bytes
    # one threshold (1 bit): a compare is what bucketize computes, at a tenth of its binary search's cost
    codes = (z > bounds[0]).to(torch.uint8) if bounds.numel() == 1 else torch.bucketize(z, bounds, out_int32=True)
    if cut is not None:  # the zero level sits between the halves: shift the positive codes up
        half = signed.numel() // 2
        shifted = codes * 2 if bits == 1 else codes + (codes >= half)  # 1 bit: {0, 1} -> {0, 2}
        codes = torch.where(keep if bits == 1 else a > cut, shifted, half)
    return _split_m(codes.reshape(-1).to(torch.uint8), s, levels, ms, starts, ns, bits=bits, group=group,
                    prune=prune, normalized=D is not None)


def _cut_stride(n: int) -> int:
    """The step of the strided sample of |u| a tensor of ``n`` elements takes its prune cut from (~65536)."""
    return max(1, n // 65536)


def _kept_mean(a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's mean |u| over what it keeps (the L2-optimal 1-bit scale), summed in fp64 and
    rounded once to fp32 (as sign_kernel: an fp32 sum's order differs between CPUs and devices,
    an fp64 sum's last bits do not reach the fp32, let alone the bf16 scale); ``a`` is overwritten."""
    return a.masked_fill_(~keep, 0).double().sum(1).div_(keep.sum(1).clamp_min(1)).float()


def _sign_fused(mf: torch.Tensor, D: torch.Tensor | None, ms: list[torch.Tensor], *, group: int, prune: float
                ) -> list[QuantizedTensor]:
    """_quantize_ms at 1 bit by the CPU kernels (quant/momentkernels.py): each tensor's cut from the
    same strided sample of |u|, then each group's scale and codes in one pass that reads m and D
    (no u, |u| or keep mask of the whole batch: 9 bytes an element). The reference's results
    (tests/test_quant_moments.py)."""
    ns = [x.numel() for x in ms]
    offsets = segment_offsets(ns)
    m = mf.numpy()
    d = m[:0] if D is None else D.reshape(-1).to("cpu", torch.float32).contiguous().numpy()
    cuts = np.zeros(len(ns), dtype=np.float32)
    if prune > 0:  # each tensor's sample and its two order statistics a tensor at a time (K.abs_cuts)
        strides = [_cut_stride(n) for n in ns]
        sizes = [-(-n // st) for n, st in zip(ns, strides)]
        ranks, w = _ranks(sizes, prune)
        lo, hi = np.zeros(len(ns), dtype=np.float32), np.zeros(len(ns), dtype=np.float32)
        K.abs_cuts(m, d, offsets, np.array(strides, dtype=np.int64), ranks, lo, hi,
                   scratch("moments.sample", max(sizes), np.float32, keep=_KEEP))
        some = [i for i, n in enumerate(ns) if n]
        cuts[some] = _lerp(lo, hi, w).numpy()[some]
    rows = [-(-n // group) for n in ns]
    scale = np.empty(sum(rows), dtype=np.int16)
    out = np.empty(sum(rows) * group, dtype=np.uint8)
    K.sign_kernel(m, d, offsets, group, cuts, prune > 0, scale.view(np.uint16), out)
    starts = [group * int(r) for r in segment_offsets(rows)]
    return _split_m(torch.from_numpy(out), torch.from_numpy(scale).view(torch.bfloat16), levels_table(1, prune), ms,
                    starts, ns, bits=1, group=group, prune=prune, normalized=D is not None)


def _split_m(codes: torch.Tensor, s: torch.Tensor, levels: torch.Tensor, ms: list[torch.Tensor], starts: list[int],
             ns: list[int], **meta) -> list[QuantizedTensor]:
    """Each tensor's records from the batch's padded codes and group scales."""
    group = meta["group"]
    return [QuantizedTensor(codes=codes[at:at + n], n_levels=int(levels.numel()), codebook=levels,
                            shape=tuple(m.shape), dtype=dtype_name(m.dtype), side={"scale": s[at // group:end // group]},
                            meta=dict(meta))
            for m, at, end, n in zip(ms, starts, starts[1:], ns)]


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x, q) (linear interpolation) of a tensor without NaN, from the two order
    statistics it needs (``_quantiles`` for fp32 on CPU)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not K.HAVE_NUMBA:
        return _quantile_reference(x, q)
    return _quantiles(np.ascontiguousarray(x.detach().numpy()), np.array([0, x.numel()]), q)[0]


def _quantiles(x: np.ndarray, at: np.ndarray, q: float) -> torch.Tensor:
    """``_quantile`` of every segment x[at[s]:at[s + 1]] (fp32, contiguous, not empty), one fp32
    value each, by the kernel selecting its two order statistics (momentkernels.order_pairs; numpy's
    partition took ~3.5x as long on a checkpoint's cuts), interpolated by torch.lerp as the
    reference does: one call over all segments, whose fp32 weights are the ones a Python float
    weight is rounded to, and the same bits per element (tests/test_quant_moments.py).
    ``_quantile_reference`` beside it is plain torch; tests check them equal."""
    ranks, w = _ranks(np.diff(at), q)
    lo, hi = np.empty(len(ranks), dtype=np.float32), np.empty(len(ranks), dtype=np.float32)
    K.order_pairs(x, at, ranks, lo, hi)
    return _lerp(lo, hi, w)


def _ranks(sizes, q: float) -> tuple[np.ndarray, torch.Tensor]:
    """The linear-interpolation quantile ``q`` of segments of ``sizes`` values: the rank of its lower
    order statistic in each (int64) and the fp32 weight of the next one."""
    pos = [q * (int(n) - 1) for n in sizes]
    ranks = [math.floor(p) for p in pos]
    return np.array(ranks, dtype=np.int64), torch.tensor([p - r for p, r in zip(pos, ranks)], dtype=torch.float32)


def _lerp(lo: np.ndarray, hi: np.ndarray, w: torch.Tensor) -> torch.Tensor:
    """The quantiles from their two order statistics and weights (``_ranks``), as torch.quantile."""
    lo_t = torch.from_numpy(lo)
    return torch.where(w == 0, lo_t, torch.lerp(lo_t, torch.from_numpy(hi), w))


def _quantile_reference(x: torch.Tensor, q: float) -> torch.Tensor:
    """_quantile by two torch.kthvalue selections (any device)."""
    pos = q * (x.numel() - 1)
    lo = math.floor(pos)
    a = torch.kthvalue(x, lo + 1).values
    if pos == lo:
        return a
    return torch.lerp(a, torch.kthvalue(x, lo + 2).values, pos - lo)


def dequantize_m(q: QuantizedTensor, D: torch.Tensor | None, dtype: torch.dtype | None = None, *,
                 v_codes: torch.Tensor | None = None, d_table: torch.Tensor | None = None) -> torch.Tensor:
    """m_q = levels[code] * scale[group] (* D_q when normalized), then 0 where ``v_codes`` (v's grid
    codes, if given) has the zero level: there both moments were exactly zero. D_q per element, or
    (``d_table``, with ``v_codes``) as its value per level of v, decode_v's second form."""
    group = int(q.meta["group"])
    n = q.numel
    normalized = bool(q.meta.get("normalized"))
    s = q.side.get("scale")
    if s is None or s.numel() != -(-n // group):
        raise ValueError(f"{n} codes in groups of {group} need {-(-n // group)} scales, "
                         f"found {None if s is None else s.numel()}")
    if d_table is not None and v_codes is None:
        raise ValueError("a denominator by level needs the codes of its exp_avg_sq")
    if normalized and D is None and d_table is None:
        raise ValueError("a normalized exp_avg needs the decoded denominator of its exp_avg_sq")
    if normalized and D is not None and D.numel() != n:
        raise ValueError(f"{n} direction codes normalized by a denominator of {D.numel()} values")
    if v_codes is not None and v_codes.numel() != n:
        raise ValueError(f"{n} direction codes beside {v_codes.numel()} codes of their exp_avg_sq")
    c, levels = q.codes.reshape(-1), q.codebook.to(torch.float32)
    vc = v_codes.reshape(-1) if v_codes is not None else None
    if _use_kernels(c) and c.is_contiguous() and c.numel() == n and (D is None or D.device.type == "cpu") \
            and (vc is None or (vc.device.type == "cpu" and vc.is_contiguous())):
        lo, hi = (int(x) for x in torch.aminmax(c)) if n else (0, 0)
        if not 0 <= lo <= hi < levels.numel():
            raise ValueError(f"direction codes outside the {levels.numel()} levels")
        u = torch.empty(n, dtype=torch.float32)  # one pass over narrow codes (quant/momentkernels.py)
        args = (c.numpy(), levels.contiguous().numpy(), s.reshape(-1).float().contiguous().numpy(), group)
        if d_table is not None:
            if not K.direction_by_level(*args, vc.numpy(), d_table.contiguous().numpy(), normalized, u.numpy()):
                raise ValueError(f"exp_avg_sq codes outside the {d_table.numel()} levels of the decode table")
        else:
            Dn = D.reshape(-1).to(torch.float32).contiguous() if normalized else u[:0]
            K.direction_values(*args, Dn.numpy(), normalized, u.numpy())
            if vc is not None:
                u[vc == 0] = 0
        return u.to(dtype or torch_dtype(q.dtype)).reshape(q.shape)
    u = levels[c.long()]  # a fresh tensor: scaled in place
    sf = s.to(u.device, torch.float32)
    full = n - n % group  # whole groups by a broadcast (repeat_interleave built a copy of the scales)
    u[:full].view(-1, group).mul_(sf[:full // group, None])
    if full < n:
        u[full:].mul_(sf[-1])
    if normalized:
        u.mul_((d_table.to(u.device)[vc.long()] if d_table is not None else D.reshape(-1)).to(u.device))
    if vc is not None:
        u[vc.to(u.device) == 0] = 0
    return u.to(dtype or torch_dtype(q.dtype)).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# one Adam parameter's (m, v) pair

NORMALIZE = ("true", "decoded")


@dataclass(frozen=True)
class GridCodec:
    """How one (m, v) pair is quantized (see the module docstring for each knob)."""

    v_step: float = 2.0       # log2 units of D per level (D within a factor 2; measured: bench/resume.py)
    factored: bool = True     # keyframes code v as residuals of row + column effects (2-D tensors)
    m_bits: int = 1           # 1 (sign), 2 or 3; 0: m is not stored (restored as zeros)
    group: int = 256          # elements per m scale
    prune: float = 0.9        # share of m zeroed by magnitude (1 bit + prune: ternary, ~0.65 bits)
    normalize: str = "true"   # u = m / D ("true") or m / D_q ("decoded")
    sgd_bits: int = 3         # SGD momentum buffers (no v: the buffer is the update direction)
    min_numel: int = 128      # smaller moment tensors stay exact (a record's own bytes outweigh theirs)

    def __post_init__(self):
        bits = OneOf(tuple(_LEVELS))
        check_fields(self, v_step=Range(gt=0, note=" (log2 units of D per level)"), m_bits=OneOf((0, *_LEVELS)),
                     group=Range(ge=1), prune=Range(ge=0, lt=1), normalize=OneOf(NORMALIZE), sgd_bits=bits,
                     min_numel=MIN_NUMEL_RANGE)


def encode_pair(m: torch.Tensor, v: torch.Tensor, hp: AdamHP, codec: GridCodec
                ) -> tuple[QuantizedTensor | None, QuantizedTensor]:
    """(m codes or None for m_bits=0, v codes) of one Adam parameter."""
    return encode_pair_levels(m, v, hp, codec)[:2]


def encode_pair_levels(m: torch.Tensor, v: torch.Tensor, hp: AdamHP, codec: GridCodec
                       ) -> tuple[QuantizedTensor | None, QuantizedTensor, torch.Tensor]:
    """encode_pair and v's absolute grid codes (= decode_grid(qv), flat, in the narrowest integer
    dtype, as qv's codes: what the next checkpoint's delta is taken against), which a factored qv
    would otherwise decode again."""
    return encode_pairs_levels([(m, v, hp)], codec)[0]


def encode_pairs_levels(pairs: list[tuple[torch.Tensor, torch.Tensor, AdamHP]], codec: GridCodec
                        ) -> list[tuple[QuantizedTensor | None, QuantizedTensor, torch.Tensor]]:
    """encode_pair_levels of many (m, v, hp) at once: their values concatenated, every elementwise
    pass runs once over all of them (a checkpoint's moments are mostly small tensors, where a
    pass costs more than its bytes); each result is the one its pair gets alone (tested)."""
    for m, v, _ in pairs:
        if m.shape != v.shape:
            raise ValueError(f"exp_avg has shape {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}")
    if not pairs:
        return []
    ms, vs = [p[0] for p in pairs], [p[1] for p in pairs]
    ns = [v.numel() for v in vs]
    _, mf, D, c, top = _grid(vs, ms, [hp for *_, hp in pairs], codec.v_step)
    qvs = _plain_records(c, ns, vs, codec.v_step, top) if not codec.factored else None
    if qvs is not None:  # the stored codes are the levels, narrowed already
        cs = [qv.codes for qv in qvs]
    else:
        at = segment_offsets(ns)
        cs = [c[a:a + n] for a, n in zip(at.tolist(), ns)]
        qvs = [_grid_record(ci, v, codec.v_step, codec.factored, top) for ci, v in zip(cs, vs)]
        # v is final: its codes and levels narrowed before m's pass allocates its own temporaries (on
        # a large tensor int64 codes and levels were 16 of the ~39 bytes an element a save peaked at)
        for qv in qvs:
            qv.codes = _own(compact(qv.codes, qv.n_levels), c)
        # each tensor's max: one reduceat over the kernel's codes (its segments all non-empty)
        tops = np.maximum.reduceat(c.numpy()[:int(at[-1])], at[:-1]).tolist() if top is not None and 0 not in ns \
            else [int(ci.max()) for ci in cs]
        cs = [qv.codes if not qv.meta["factored"] else _own(compact(ci, t + 1), c)
              for qv, ci, t in zip(qvs, cs, tops)]
    del c
    if not codec.m_bits:
        return [(None, qv, ci) for qv, ci in zip(qvs, cs)]
    if codec.normalize == "decoded":
        D = torch.cat([decode_denominator(qv, hp, ci) for qv, (*_, hp), ci in zip(qvs, pairs, cs)])
    qms = _quantize_ms(mf, D, ms, bits=codec.m_bits, group=codec.group, prune=codec.prune)
    return list(zip(qms, qvs, cs))


def _plain_records(c: torch.Tensor, ns: list[int], vs: list[torch.Tensor], step: float, top: int | None
                   ) -> list[QuantizedTensor] | None:
    """``_grid_record(ci, v, step, False)`` of every tensor's codes ci at once where the grid kernel
    ran (CPU, its max ``top`` known) and every code fits uint8: one narrowing pass and one max per
    tensor over the batch (each record's codes a view of the narrowed batch), instead of ~10 us of
    torch calls a tensor. None: call _grid_record per tensor."""
    if top is None or top > 255 or not _use_kernels(c) or 0 in ns:
        return None
    at = segment_offsets(ns)
    tops = np.maximum.reduceat(c.numpy()[:int(at[-1])], at[:-1]).tolist()  # every segment is non-empty
    c8, at, none = c[:int(at[-1])].to(torch.uint8), at.tolist(), torch.empty(0)
    return [QuantizedTensor(codes=c8[a:e], n_levels=t + 1, codebook=none, shape=tuple(v.shape),
                            dtype=dtype_name(v.dtype), meta={"step": step, "factored": False})
            for a, e, t, v in zip(at, at[1:], tops, vs)]


def _own(x: torch.Tensor, scratch_codes: torch.Tensor) -> torch.Tensor:
    """``x``, copied if it still holds the scratch codes' memory (int32 levels: compact kept them)."""
    same = x.untyped_storage().data_ptr() == scratch_codes.untyped_storage().data_ptr()
    return x.clone() if same else x


def _per_element(values: list[float], ns: list[int], like: torch.Tensor) -> float | torch.Tensor:
    """One value per tensor as an operand over the concatenated tensors of sizes ``ns``: the value
    itself when they agree (one optimizer param group: the usual case), else fp32 per element (an
    op converts a Python float operand to fp32 as well: the same results)."""
    if len(set(values)) == 1:
        return values[0]
    return torch.cat([like.new_full((n,), x) for x, n in zip(values, ns)])


def _cat32(xs: list[torch.Tensor], name: str) -> torch.Tensor:
    """The flat fp32 values of ``xs``, one after the other (a view of a lone flat fp32 tensor); on
    the CPU in this thread's scratch buffer ``name``, valid until the next save's batch."""
    if len(xs) == 1:
        return xs[0].detach().reshape(-1).to(torch.float32)
    flat = [flat32(x) for x in xs]
    if any(x.device.type != "cpu" for x in flat):
        return torch.cat(flat)
    return torch.cat(flat, out=torch.from_numpy(scratch(name, sum(x.numel() for x in flat), np.float32, keep=_KEEP)))


def decode_pair(qm: QuantizedTensor | None, qv: QuantizedTensor, hp: AdamHP, m_dtype: str = "float32"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) in their stored dtypes: v first, then m from the decoded denominator (zeros if qm is None)."""
    c = decode_grid(qv)
    v, D, d_table = decode_v(qv, hp, c, dtype=torch_dtype(qv.dtype))
    if qm is None:
        return torch.zeros(qv.shape, dtype=torch_dtype(m_dtype)), v
    return dequantize_m(qm, D, v_codes=c, d_table=d_table), v
