"""DynaQuant's side of the config search: sketch once per checkpoint, estimate every candidate from
histograms, quantize only the candidates that are evaluated.

The search (search/strategies.py) asks a method for ``search_prepare(state, reference, gradients)``
and then, per candidate config (knobs)::

    prep = SearchSketch(weights, base_config, grads, reference_codes, coding)   # one sketch pass
    est_bits, raw_bits = prep.estimate(knobs)     # histograms only (the first: one joint-histogram pass)
    qs = prep.quantize(knobs)                     # partition + assign passes (same as quantize_tensors)

``estimate`` models the encoder at bucket granularity: each tensor's signed LogSketch histogram is
partitioned by its representatives against the candidate's magnitude thresholds (a sensitivity
candidate is estimated with magnitude thresholds at the same fractions: the joint distribution of
|x| and |x g| is not sketched), the quantized buckets are clustered by the same batched k-means as
the quantizer, every bucket takes its representative's code, and the codes' entropy is counted:
H(codes) for a keyframe, H(code | previous code) (``coding="conditional"``, what the rearranged
delta exploits) or H(delta) (``"delta"``) against the reference, whose joint (previous code,
bucket) counts are taken once per checkpoint. Side costs as ``strategies.estimate_bits``: 16 bits
per protected value, 32 per codebook entry. bench/search.py measures its rank correlation with
the encoded sizes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch

from ..logbuckets import HAVE_NUMBA, lookup_table, raise_nonfinite
from ..sketch import LogSketch
from . import dynaquant as dq
from .dqbatch import Sketched, Chunk, _merged, row_quantiles
from .levels import histogram_centers, level_bounds

if HAVE_NUMBA:
    import numba as _numba

    from ..logbuckets import _BLOCK, emit_counts, fold_block

__all__ = ["SearchSketch", "joint_counts", "joint_counts_reference"]


class SearchSketch:
    """One checkpoint's weights, sketched once, for every candidate config of the search."""

    def __init__(self, tensors: Mapping[str, tuple], config: dq.DynaQuantConfig,
                 grads: Mapping[str, torch.Tensor] | None = None, reference: Mapping | None = None,
                 coding: str = "conditional", *, threads: int | None = None):
        self.base, self.coding = config, coding
        self.sk = Sketched(tensors, config, grads, threads=threads)
        rows = self.sk.rows()
        self.names = list(self.sk.order)
        signed = [rows[n][2] for n in self.names]
        pad = torch.nn.utils.rnn.pad_sequence
        self.ords = pad([o for o, _ in signed], batch_first=True) if signed else torch.zeros(0, 0, dtype=torch.int64)
        self.counts = pad([c for _, c in signed], batch_first=True) if signed else torch.zeros(0, 0, dtype=torch.int64)
        self.nb = torch.tensor([o.numel() for o, _ in signed], dtype=torch.int64)
        self.rep = LogSketch(config.alpha).ordinal_values(self.ords)                  # (R, B) float64
        self.raw_bits = float(sum(self.sk.specs[n][0].numel() * self.sk.specs[n][0].element_size() * 8
                                  for n in self.names))
        self._reference = reference if coding != "plain" and reference else None
        self._joint: tuple | None = None  # ``joint``, counted at the first estimate
        self.prev_levels = {n: int(reference[n].n_levels) for n in self.names if reference and n in reference}
        self._index = {n: i for i, n in enumerate(self.names)}
        self._mag: dict[str, LogSketch] = {}            # layer type -> merged |x| sketch
        self._cap: dict[tuple, list[float]] = {}        # (layer type, quantile) -> per-row caps
        self._const: dict | None = None                 # _constant_terms

    # ------------------------------------------------------------------ candidates
    def config(self, knobs: dict) -> dq.DynaQuantConfig:
        return replace(self.base, **knobs) if knobs else self.base

    def quantize(self, knobs: dict) -> dict:
        """Every weight under the candidate: exactly ``quantize_tensors`` (no second sketch pass)."""
        cfg = self.config(knobs)
        return self.sk.quantize(self.sk.plan(cfg))

    def estimate(self, knobs: dict) -> tuple[float, float]:
        """(estimated encoded bits, raw bits) of the candidate, from the histograms alone."""
        return self.estimate_many([knobs])[0]

    def estimate_many(self, knobs_list: list[dict]) -> list[tuple[float, float]]:
        """``estimate`` of every candidate, their histograms clustered in one batch: a row (tensor)
        whose thresholds and level count two candidates share is clustered once, and a row's
        result does not depend on the batch, so each estimate is the one ``estimate`` gives."""
        cfgs = [self.config(k) for k in knobs_list]
        R = len(self.names)
        if R == 0:
            return [(0.0, 0.0)] * len(cfgs)
        th = [self._thresholds(cfg) for cfg in cfgs]                         # (R,) float64, (R,)
        # the distinct (row, prune, protect, bins, k-means settings) of all candidates
        fits = {_fit_key(cfg): cfg for cfg in cfgs}
        keys = list(fits)
        rows = torch.arange(R, dtype=torch.float64)
        cols = [torch.stack([rows, p, q, b.double(), torch.full_like(rows, float(keys.index(_fit_key(cfg))))], 1)
                for (p, q, b), cfg in zip(th, cfgs)]
        u, slot = torch.unique(torch.cat(cols), dim=0, return_inverse=True)  # (U, 5), (C * R,)
        row = u[:, 0].long()
        rep, nb, cnt = self.rep[row], self.nb[row], self.counts[row]
        a = rep.abs()
        valid = torch.arange(rep.shape[1])[None, :] < nb[:, None]
        pruned = valid & ((rep == 0) | (a < u[:, 1:2]))
        protected = valid & (a > u[:, 2:3]) & ~pruned
        quant = valid & ~pruned & ~protected
        codes, k = self._codes(row, u[:, 3].long(), [keys[int(f)] for f in u[:, 4]], fits, quant, rep)
        codes = torch.where(pruned, 0, torch.where(protected, k[:, None] + 1, codes))
        cnt = torch.where(valid, cnt, 0)
        side = 32.0 * (k + 2).double() + 16.0 * (cnt * protected).sum(1).double()   # (U,)
        slot = slot.reshape(len(cfgs), R)
        return [(e, self.raw_bits) for e in self._entropies(codes, k, slot, [float(side[s].sum()) for s in slot])]

    def _entropies(self, codes: torch.Tensor, k: torch.Tensor, slot: torch.Tensor, est: list[float]) -> list[float]:
        """``est`` (one figure per candidate) plus each candidate's coded size of its bucket codes by
        the search's coding; ``codes`` (U, B) and ``k`` (U,) of the distinct rows, candidate s's row
        r is ``slot[s, r]``. All candidates' cells are counted in one bincount."""
        R = len(self.names)
        L = int(k.max()) + 2
        const = self._constant_terms()
        if self.joint is not None and self.joint[0].numel():
            r, p, b, c = self.joint
            new = codes[slot[:, r], b]                                          # (C, cells)
            Lp = max(self.prev_levels.values())
            if self.coding == "conditional":  # n H(code | prev) = sum_p c_p log c_p - sum c log c
                terms = _neg_clogc(r * (Lp * L) + p * L + new, c, R * Lp * L)
                est = [e + (t - const["joint"]) for e, t in zip(est, terms)]
            else:                             # n H(delta), delta = (new - prev) mod B
                Bmax = max(L, Lp)
                B = torch.maximum(k[slot] + 2, const["prev_levels"])                 # (C, R)
                terms = _neg_clogc(r * Bmax + torch.remainder(new - p, B[:, r]), c, R * Bmax)
                est = [e + (const["joint"] + t) for e, t in zip(est, terms)]
        rr = const["keyrows"]
        if rr.numel():                        # n H(codes)
            terms = _neg_clogc((rr[:, None] * L + codes[slot[:, rr]]).reshape(len(est), -1),
                               self.counts[rr].reshape(-1), R * L)
            est = [e + (const["key"] + t) for e, t in zip(est, terms)]
        return est

    def _constant_terms(self) -> dict:
        """The parts of ``_entropies`` that no candidate changes, computed once: the rows coded
        without reference codes, their counts' n log n, the reference codes' own term (and, for
        ``"delta"``, each row's previous level count)."""
        if self._const is None:
            R = len(self.names)
            keyrows = torch.ones(R, dtype=torch.bool)
            const = {}
            if self.joint is not None and self.joint[0].numel():
                r, p, b, c = self.joint
                Lp = max(self.prev_levels.values())
                if self.coding == "conditional":
                    const["joint"] = _neg_clogc((r * Lp + p)[None], c, R * Lp)[0]
                else:
                    const["joint"] = _nlogn(torch.bincount(r, weights=c.double(), minlength=R))
                    const["prev_levels"] = torch.tensor([self.prev_levels.get(n, 0) for n in self.names])
                keyrows[torch.unique(r)] = False
            const["keyrows"] = rr = torch.arange(R)[keyrows]
            const["key"] = _nlogn(self.counts[rr].sum(1).double()) if rr.numel() else 0.0
            self._const = const
        return self._const

    # ------------------------------------------------------------------ internals
    @property
    def joint(self) -> tuple | None:
        """(row, previous code, bucket index, count) of the tensors with reference codes (None:
        none to code against), one pass over the weights at the first estimate (an exhaustive
        search estimates its trials from their codes and never asks)."""
        if self._joint is None and self._reference is not None:
            rows = self.sk.rows()
            self._joint = joint_counts(self.sk, {n: rows[n][2] for n in self.names}, self._reference)
        return self._joint

    def _thresholds(self, cfg: dq.DynaQuantConfig):
        """Per row: prune below (float64), protect above, bins -- magnitude thresholds of the layer
        type (protection: the top F_prot by magnitude), capped per tensor as the quantizer does."""
        cap_q = dq.prune_cap_quantile(cfg)
        R = len(self.names)
        prune, protect, bins = [-math.inf] * R, [math.inf] * R, [0] * R  # lists: a tensor item write is ~5 us
        for lt, items in self.sk.groups.items():
            ltp = dq.layer_type_plan(lt, 0, self._type_sketch(lt), None, cfg)
            caps = [math.inf] * len(items)
            if cap_q is not None and lt != "embedding":
                caps = self._caps(lt, cap_q)
            for n, cap in zip(items, caps):
                i = self._index[n]
                if ltp.prune_threshold is not None:
                    prune[i] = min(ltp.prune_threshold, cap)
                if ltp.protect_magnitude is not None:
                    protect[i] = ltp.protect_magnitude
                bins[i] = ltp.bins
        prune, protect = torch.tensor(prune, dtype=torch.float64), torch.tensor(protect, dtype=torch.float64)
        bins = torch.tensor(bins, dtype=torch.int64)
        return prune, protect, bins

    def _type_sketch(self, lt: str) -> LogSketch:
        """The merged |x| sketch of a layer type (the same for every candidate)."""
        if lt not in self._mag:
            rows = self.sk.rows()
            self._mag[lt] = _merged([rows[n][0] for n in self.sk.groups[lt]], self.base.alpha)
        return self._mag[lt]

    def _caps(self, lt: str, q: float) -> list[float]:
        if (lt, q) not in self._cap:
            rows = self.sk.rows()
            self._cap[lt, q] = row_quantiles([rows[n][0] for n in self.sk.groups[lt]], q, self.base.alpha)
        return self._cap[lt, q]

    def _codes(self, row: torch.Tensor, bins: torch.Tensor, fit: list[tuple], cfg_of: dict, quant: torch.Tensor,
               rep: torch.Tensor):
        """Code of every bucket (by its representative) and the level count k of distinct rows
        (tensor ``row`` with level count ``bins`` and k-means settings ``fit``, a key of ``cfg_of``;
        its buckets to cluster ``quant``): one k-means batch per (bins, settings)."""
        U = row.numel()
        ords, counts, nq = self.ords[row], self.counts[row], quant.sum(1)
        centers: list[torch.Tensor | None] = [None] * U
        groups: dict[tuple, list[int]] = {}
        for i, key in enumerate(zip(bins.tolist(), fit)):
            groups.setdefault(key, []).append(i)
        for (k, f), idx in groups.items():
            m = quant[idx]
            ptr = torch.cat([torch.zeros(1, dtype=torch.int64), nq[idx].cumsum(0)])
            for i, c in zip(idx, histogram_centers(ords[idx][m], counts[idx][m], ptr, k, cfg_of[f])):
                centers[i] = c
        k = torch.tensor([c.numel() for c in centers], dtype=torch.int64)
        pad = torch.nn.utils.rnn.pad_sequence(centers, batch_first=True, padding_value=math.inf)
        bounds = torch.full((U, max(1, int(k.max()) - 1)), math.inf, dtype=torch.float64)
        for d in {f[0] for f in fit}:
            sel = [i for i, f in enumerate(fit) if f[0] == d]
            b = level_bounds(pad[sel], d).double()
            bounds[sel, :b.shape[1]] = b
        return 1 + torch.searchsorted(bounds, rep.contiguous()), k


def _fit_key(cfg: dq.DynaQuantConfig) -> tuple:
    """The settings a row's clustering depends on besides its histogram and level count."""
    return (cfg.domain, cfg.kmeans, cfg.sigma, cfg.seed)


# above this many cells (rows x previous levels x levels: 256 levels on a few hundred tensors) the
# cells are binned by a sort of the ones present instead of a dense count table
DENSE_CELLS = 1 << 22


def _neg_clogc(cells: torch.Tensor, counts: torch.Tensor, size: int) -> list[float]:
    """-sum c log2 c over the cells of ``counts`` (n,) binned by each row of ``cells`` (C, n), all
    rows in one pass. A row's cells are summed in cell order either way (a dense table, or a sort
    of the cells present): the counts are integers, so the bins are exact, and a row's figure is
    the one it gives alone."""
    C = cells.shape[0]
    at = cells + size * torch.arange(C)[:, None]
    w = counts.to(torch.float64).repeat(C)
    if C * size > DENSE_CELLS:
        present, inv = torch.unique(at.reshape(-1), return_inverse=True)
        c = torch.zeros(present.numel(), dtype=torch.float64).index_add_(0, inv, w)
        rows = torch.searchsorted(present, size * torch.arange(C + 1)).tolist()
        parts = [c[a:z] for a, z in zip(rows, rows[1:])]
    else:
        parts = torch.bincount(at.reshape(-1), weights=w, minlength=C * size).reshape(C, size).unbind(0)
    out = []
    for c in parts:
        c = c[c > 0]
        out.append(float(-(c * torch.log2(c)).sum()))
    return out


def _nlogn(n: torch.Tensor) -> float:
    n = n[n > 0]
    return float((n * torch.log2(n)).sum())


def joint_counts(sk: Sketched, signed_rows: Mapping[str, tuple], reference: Mapping) -> tuple:
    """(row, previous code, bucket index, count) of every tensor whose reference codes have its
    size: one pass over the weights (numba; ``joint_counts_reference`` is the same in torch)."""
    if not HAVE_NUMBA:
        return joint_counts_reference(sk, signed_rows, reference)
    t = lookup_table(sk.alpha, 1e-30)
    M = int(t.key.max())
    index = {n: i for i, n in enumerate(sk.order)}
    parts = []
    d = np.zeros((0, 2 * M + 2), dtype=np.int64)  # the count table, all zero between segments: one for every chunk
    for c in sk.chunks:
        prev, L, rows, lo, maps = _chunk_refs(c, signed_rows, reference, index)
        if prev is None:
            continue
        if d.shape[0] < L:
            d = np.zeros((L, 2 * M + 2), dtype=np.int64)
        x = c.x.numpy()
        cap = int(sum(min(c.offsets[i + 1] - c.offsets[i], L * (m.size)) for i, m in enumerate(maps) if m is not None))
        out = np.empty((4, cap), dtype=np.int64)
        lut = np.concatenate([m if m is not None else np.zeros(0, np.int32) for m in maps]).astype(np.int32)
        lut_off = np.concatenate([[0], np.cumsum([m.size if m is not None else 0 for m in maps])]).astype(np.int64)
        n = _joint_kernel(x.view(np.int32), x, prev, c.offsets, np.array(rows, np.int64), np.array(lo, np.int64),
                          lut, lut_off, M, t.shift, t.key, t.bound, d, out)
        if n < 0:  # the sketch pass raises first; kept so that no count is ever written out of range
            raise_nonfinite(c.x[c.seg(-1 - n)], c.names[-1 - n])
        parts.append(torch.from_numpy(out[:, :n].copy()))
    if not parts:
        return tuple(torch.zeros(0, dtype=torch.int64) for _ in range(4))
    j = torch.cat(parts, 1)
    return j[0], j[1], j[2], j[3]


def _chunk_refs(c: Chunk, signed_rows, reference, index):
    """The previous codes of a chunk's segments, packed (unset in segments without: row -1), one
    more than the largest, and per segment: row index, lowest ordinal, and the ordinal -> bucket
    index map of its row."""
    refs, rows, lo, maps = [], [], [], []  # refs: (segment, its previous codes)
    for i, n in enumerate(c.names):
        ords = signed_rows[n][0]
        ref = reference.get(n) if reference else None
        seg = c.seg(i)
        if ref is not None and ref.codes.numel() == seg.stop - seg.start and ords.numel():
            refs.append((seg, ref.codes.reshape(-1).numpy()))
            o0 = int(ords[0])
            m = np.full(int(ords[-1]) - o0 + 1, -1, dtype=np.int32)
            m[(ords - o0).numpy()] = np.arange(ords.numel(), dtype=np.int32)
            rows.append(index[n])
            lo.append(o0)
            maps.append(m)
        else:
            rows.append(-1)
            lo.append(0)
            maps.append(None)
    if not refs:
        return None, 0, rows, lo, maps
    prev = np.empty(c.x.numel(), dtype=np.result_type(*(a.dtype for _, a in refs)))  # uint8 codes stay uint8
    for seg, a in refs:
        prev[seg] = a
    return prev, max(int(a.max()) for _, a in refs) + 1, rows, lo, maps


def joint_counts_reference(sk: Sketched, signed_rows: Mapping[str, tuple], reference: Mapping) -> tuple:
    """``joint_counts`` in plain torch: ordinals -> bucket index by searchsorted, then one bincount."""
    out = []
    for r, n in enumerate(sk.order):
        ref = reference.get(n) if reference else None
        x = sk.specs[n][0].detach().reshape(-1)
        ords = signed_rows[n][0]
        if ref is None or ref.codes.numel() != x.numel() or not ords.numel():
            continue
        b = torch.searchsorted(ords, LogSketch(sk.alpha).ordinals(x.float()))
        p = ref.codes.reshape(-1).long()
        nb = ords.numel()
        cnt = torch.bincount(p * nb + b)
        cells = cnt.nonzero().squeeze(1)
        out.append(torch.stack([torch.full_like(cells, r), cells // nb, cells % nb, cnt[cells]]))
    if not out:
        return tuple(torch.zeros(0, dtype=torch.int64) for _ in range(4))
    j = torch.cat(out, 1)
    return j[0], j[1], j[2], j[3]


if HAVE_NUMBA:
    @_numba.njit(cache=True, nogil=True)
    def _joint_kernel(bits, x, prev, offsets, rows, lo, lut, lut_off, M, shift, key, bound, d,
                      out):  # pragma: no cover - compiled
        """Counts per segment with reference codes by (previous code, folded bucket) in ``d`` (a
        row per code, zero on entry and on return), then its non-zero cells as (row, code, bucket
        index, count) columns of ``out``, in (code, bucket index) order. Returns the number
        written, or -1 - s where segment s holds inf/NaN. A block's buckets first, branch-free
        (``fold_block``), then its counts, as the sketch pass's ``_hist_kernel``; buckets become
        bucket indices only per non-zero cell (``emit_counts``, which zeroes what it read, then
        the row's map)."""
        W = 2 * M + 2
        block = np.empty(_BLOCK, np.int32)
        ords = np.empty(W + 1, np.int64)
        counts = np.empty(W + 1, np.int64)
        n = 0
        for s in range(offsets.shape[0] - 1):
            if rows[s] < 0:
                continue
            a, e = offsets[s], offsets[s + 1]
            lo_f, hi_f, top = 2 * M + 1, 0, 0
            while a < e:
                m = min(e - a, _BLOCK)
                blo, bhi = fold_block(bits, x, a, m, shift, key, bound, M, block)
                if blo < 0:
                    return -1 - s
                for t in range(m):
                    p = prev[a + t]
                    d[p, block[t]] += 1
                    top = max(top, p)
                lo_f = min(lo_f, blo)
                hi_f = max(hi_f, bhi)
                a += m
            bmap = lut[lut_off[s]:lut_off[s + 1]]
            for p in range(np.int64(top) + 1):
                k = emit_counts(d[p], lo_f, hi_f, False, True, ords, counts, 0)
                for i in range(k):
                    out[0, n] = rows[s]
                    out[1, n] = p
                    out[2, n] = bmap[ords[i] - lo[s]]
                    out[3, n] = counts[i]
                    n += 1
        return n
else:  # pragma: no cover
    _joint_kernel = None
